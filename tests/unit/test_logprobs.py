"""The trainer's logprobs of response tokens against the full-vocabulary computation it replaces."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from roles import trainer
from tinymodel import ARCHITECTURES, make_config


def full_vocabulary_logprobs(model, input_ids, attention_mask, temperature):
    """The reference: fp32 logits at every position, log-softmax over the whole vocabulary; [batch, T-1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def model_of(arch: str, tied: bool, vocab: int = 300):
    torch.manual_seed(0)
    config = make_config(arch, hidden=128, layers=2, intermediate=256, vocab=vocab, init_std=0.2)
    config.tie_word_embeddings = tied
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def right_padded_batch(vocab: int):
    """Three sequences of 24, 17 and 9 tokens; responses start at 10, 5 and 8."""
    g = torch.Generator().manual_seed(1)
    lengths, prompts = (24, 17, 9), (10, 5, 8)
    ids = torch.zeros(3, 24, dtype=torch.long)
    attention = torch.zeros(3, 24, dtype=torch.long)
    mask = torch.zeros(3, 23)
    for i, (n, p) in enumerate(zip(lengths, prompts)):
        ids[i, :n] = torch.randint(2, vocab, (n,), generator=g)
        attention[i, :n] = 1
        mask[i, p - 1:n - 1] = 1
    return ids, attention, mask


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("tied", [True, False])
def test_response_logprobs_equal_the_full_vocabulary_ones(arch, tied, monkeypatch):
    model = model_of(arch, tied)
    ids, attention, mask = right_padded_batch(300)
    # 7 positions per chunk: 6 chunks for the 37 response positions, the last one short
    monkeypatch.setattr(trainer, "LOGIT_CHUNK_BYTES", 4 * 300 * 7)
    assert trainer.logit_chunk_positions(300) == 7
    for temperature in (1.0, 0.7):
        expected = full_vocabulary_logprobs(model, ids, attention, temperature) * mask
        got = trainer.response_logprobs(model, ids, attention, mask, temperature)
        assert got.shape == mask.shape and torch.equal(got[mask == 0], torch.zeros(int((mask == 0).sum())))
        assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("tied", [True, False])
def test_gradients_through_the_recomputed_chunks_equal_the_full_ones(tied, monkeypatch):
    model = model_of("qwen2", tied)
    ids, attention, mask = right_padded_batch(300)
    weights = torch.linspace(-1, 1, mask.numel()).view(mask.shape)  # a loss that weighs every token differently
    (full_vocabulary_logprobs(model, ids, attention, 0.7) * mask * weights).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr(trainer, "LOGIT_CHUNK_BYTES", 4 * 300 * 5)
    (trainer.response_logprobs(model, ids, attention, mask, 0.7) * weights).sum().backward()
    for name, p in model.named_parameters():
        assert (p.grad - expected[name]).norm() <= 1e-5 * expected[name].norm() + 1e-9, name


def test_a_batch_with_no_response_token_still_gives_the_head_a_gradient():
    """FSDP reduces the root unit's gradients on every rank: an untied lm_head must have one (zero)."""
    model = model_of("llama", tied=False)
    ids, attention, mask = right_padded_batch(300)
    logp = trainer.response_logprobs(model, ids, attention, torch.zeros_like(mask), 1.0)
    assert torch.equal(logp, torch.zeros_like(mask))
    logp.sum().backward()
    assert torch.equal(model.lm_head.weight.grad, torch.zeros_like(model.lm_head.weight))


def test_models_that_scale_their_logits_are_refused():
    model = model_of("qwen2", tied=True)
    model.config.final_logit_softcapping = 30.0
    ids, attention, mask = right_padded_batch(300)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        trainer.response_logprobs(model, ids, attention, mask, 1.0)
