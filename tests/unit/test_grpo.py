import math

import pytest
import torch

from algorithm import LOSS_AGGS, grpo_advantages
from roles.trainer import (grpo_loss_sum, loss_denominator, micro_batches, pack,
                           rollout_is_weights, token_weights, warmup_lr)
from roles.rollout import Sample


def test_advantages_hand_checked():
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]]))
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: mean 0.75, std 0.5
    a = 0.5 / math.sqrt(1 / 3)
    assert adv[0].tolist() == pytest.approx([a, -a, -a, a], abs=1e-5)
    assert adv[1].tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5], abs=1e-5)


def test_equal_rewards_give_zero_advantage_and_no_gradient():
    adv = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(adv, torch.zeros(2, 3))
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    loss = grpo_loss_sum(logp, logp.detach(), adv[:, 0], torch.ones(2, 2), clip_eps=0.2)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 2))


def test_advantages_without_std_scaling():
    adv = grpo_advantages(torch.tensor([[2.0, 0.0]]), scale_by_std=False)
    assert adv.tolist() == [[1.0, -1.0]]


def test_loss_on_policy_is_minus_advantage_per_masked_token():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss = grpo_loss_sum(logp, logp, torch.tensor([1.0, -1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1 * 2 + 1 * 1)


@pytest.mark.parametrize("log_ratio, adv, expected", [
    (0.5, 1.0, -1.2),               # ratio 1.65 > 1.2, positive advantage: clipped
    (0.5, -1.0, math.exp(0.5)),     # negative advantage: the unclipped (worse) term wins
    (-0.5, 1.0, -math.exp(-0.5)),   # ratio 0.61 < 0.8, positive advantage: unclipped
    (-0.5, -1.0, 0.8),              # negative advantage: clipped at 0.8
])
def test_loss_clipping(log_ratio, adv, expected):
    old = torch.tensor([[-1.0]])
    loss = grpo_loss_sum(old + log_ratio, old, torch.tensor([adv]), torch.ones(1, 1), clip_eps=0.2)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("log_ratio, adv, expected", [
    (math.log(1.25), 1.0, -1.25),   # ratio 1.25: within 1 + 0.28, positive advantage, unclipped
    (0.5, 1.0, -1.28),              # ratio 1.65 > 1.28: clipped at the higher bound
    (-0.5, -1.0, 0.8),              # the lower bound stays 1 - 0.2
    (0.5, -1.0, math.exp(0.5)),     # negative advantage above the bound: the unclipped term wins
])
def test_clip_higher(log_ratio, adv, expected):
    """DAPO's clip-higher: the ratio clipped to [1 - 0.2, 1 + 0.28]."""
    old = torch.tensor([[-1.0]])
    loss = grpo_loss_sum(old + log_ratio, old, torch.tensor([adv]), torch.ones(1, 1), clip_eps=0.2,
                         clip_eps_high=0.28)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_loss_aggregations_by_hand():
    """verl's agg_loss (verl/trainer/ppo/core_algos.py) on two responses of 2 and 1 tokens whose token
    losses are 1, 2 (and a padded 5) and 4: token-mean (1 + 2 + 4) / 3, seq-mean-token-mean
    (1.5 + 4) / 2, seq-mean-token-sum (3 + 4) / 2. On policy with advantage -1 each token's loss is 1,
    so an advantage of -x gives token loss x."""
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    per_token = torch.tensor([[1.0, 2.0, 5.0], [4.0, 0.0, 0.0]])
    expected = {"token-mean": 7 / 3, "seq-mean-token-mean": 2.75, "seq-mean-token-sum": 3.5}
    assert set(expected) == set(LOSS_AGGS)
    for agg, value in expected.items():
        weights = token_weights(mask, agg)
        # the loss is linear in the advantage per token: sum the per-token losses through the weights
        total = sum(grpo_loss_sum(logp[:, t:t + 1], logp[:, t:t + 1], -per_token[:, t], weights[:, t:t + 1],
                                  clip_eps=0.2) for t in range(3))
        assert (total / loss_denominator(3, 2, agg)).item() == pytest.approx(value, rel=1e-6), agg
    assert torch.equal(token_weights(mask, "token-mean"), mask)  # token-mean: the mask itself


def test_learning_rate_warm_up_by_hand():
    assert [warmup_lr(1e-3, k, 4) for k in (1, 2, 3, 4, 5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert [warmup_lr(1e-3, k, 0) for k in (1, 2)] == [1e-3, 1e-3]


def test_clipped_tokens_have_no_gradient():
    old = torch.tensor([[-1.0, -1.0]])
    logp = (old + torch.tensor([[0.5, 0.1]])).requires_grad_()
    grpo_loss_sum(logp, old, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2).backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-math.exp(0.1))


def test_kl_penalty_is_k3():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    loss = grpo_loss_sum(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), 0.2, ref_logp=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(0.1 * (math.exp(-0.5) + 0.5 - 1))


def test_pack_aligns_response_tokens_with_their_logprobs():
    s = Sample(0, 0, prompt_ids=[5, 6, 7], response_ids=[8, 9], logprobs=[-0.1, -0.2], finish_reason="stop")
    t = Sample(0, 1, prompt_ids=[5], response_ids=[4], logprobs=[-0.3], finish_reason="stop")
    batch = pack([s, t], torch.device("cpu"))
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    # position t of the outputs predicts token t+1
    assert batch["mask"].tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert torch.allclose(batch["old_logp"], torch.tensor([[0, 0, -0.1, -0.2], [-0.3, 0, 0, 0]]))


def sample_of(prompt: int, response: int) -> Sample:
    return Sample(0, 0, [5] * prompt, [6] * response, [-0.1] * response, "stop")


def test_micro_batches_by_count():
    samples = [sample_of(2, 2) for _ in range(7)]
    assert [len(b) for b in micro_batches(samples, 3)] == [3, 3, 1]
    assert [s for b in micro_batches(samples, 3) for s in b] == samples  # in order, each once


def test_micro_batches_by_padded_tokens():
    # lengths 4, 6, 3, 10, 12, 2, 2: a budget of 12 tokens counts each micro-batch padded to its longest
    lengths = [(2, 2), (3, 3), (1, 2), (4, 6), (6, 6), (1, 1), (1, 1)]
    samples = [sample_of(p, r) for p, r in lengths]
    batches = micro_batches(samples, 32, max_tokens=12)
    # [4, 6]: 2 x 6 = 12 fits; + 3 would make 3 x 6 = 18. [3]; + 10 would be 2 x 10 = 20. [10] alone;
    # [12] alone (exactly the budget); [2, 2]: 2 x 2 = 4.
    assert [[len(s.prompt_ids) + len(s.response_ids) for s in b] for b in batches] == [[4, 6], [3], [10], [12], [2, 2]]
    # a sample longer than the budget is a micro-batch of its own, never dropped or split
    assert [len(b) for b in micro_batches([sample_of(2, 2), sample_of(20, 20), sample_of(2, 2)], 32, 12)] == [1, 1, 1]
    # both bounds apply
    assert [len(b) for b in micro_batches(samples[5:] * 3, 2, max_tokens=100)] == [2, 2, 2]


def loss_and_grad(log_ratio: float, adv: float, clip_ratio_c: float = 0.0):
    old = torch.tensor([[-2.0]])
    logp = (old + log_ratio).requires_grad_()
    loss = grpo_loss_sum(logp, old, torch.tensor([adv]), torch.ones(1, 1), clip_eps=0.2, clip_ratio_c=clip_ratio_c)
    loss.backward()
    return loss.item(), logp.grad.item()


def test_log_ratio_is_clamped_before_exp():
    # unclamped, exp(100) overflows fp32 and the unclipped branch's gradient is 0 * inf = NaN
    loss, grad = loss_and_grad(100.0, 1.0)
    assert (loss, grad) == (pytest.approx(-1.2), 0.0)  # the clipped term, constant
    # negative advantage: -ratio * A with the ratio held at e^20, and no gradient past the clamp
    loss, grad = loss_and_grad(100.0, -1.0)
    assert (loss, grad) == (pytest.approx(math.exp(20.0), rel=1e-6), 0.0)
    loss, grad = loss_and_grad(-100.0, 1.0)
    assert (loss, grad) == (pytest.approx(-math.exp(-20.0), rel=1e-6), 0.0)
    # inside the bound nothing changes: -ratio * A and its gradient -ratio * A
    loss, grad = loss_and_grad(0.1, 1.0)
    assert (loss, grad) == (pytest.approx(-math.exp(0.1), rel=1e-6), pytest.approx(-math.exp(0.1), rel=1e-6))


@pytest.mark.parametrize("log_ratio, adv, expected_loss, expected_grad", [
    (math.log(5.0), -1.0, 3.0, 0.0),                     # ratio 5 > C = 3: the loss stops at -C * A = 3
    (math.log(5.0), -2.0, 6.0, 0.0),                     # -C * A scales with the advantage
    (math.log(2.0), -1.0, 2.0, 2.0),                     # ratio 2 < C: -ratio * A = 2, gradient -ratio * A
    (math.log(0.5), -1.0, 0.8, 0.0),                     # the usual lower clip, 0.8
    (math.log(5.0), 1.0, -1.2, 0.0),                     # a positive advantage: the dual clip does not apply
])
def test_dual_clip_for_negative_advantages(log_ratio, adv, expected_loss, expected_grad):
    loss, grad = loss_and_grad(log_ratio, adv, clip_ratio_c=3.0)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert grad == pytest.approx(expected_grad, rel=1e-6, abs=1e-12)


def test_dual_clip_off_is_the_plain_clipped_objective_exactly():
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(6, 9, generator=g) * 5, -torch.rand(6, 9, generator=g) * 5
    adv, mask = torch.randn(6, generator=g), (torch.rand(6, 9, generator=g) > 0.3).float()
    ratio = torch.exp(logp - old)
    plain = -torch.minimum(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.2) * adv[:, None])
    assert torch.equal(grpo_loss_sum(logp, old, adv, mask, clip_eps=0.2, clip_ratio_c=0.0), (plain * mask).sum())
    # and with it on, only tokens with a negative advantage and a ratio above 3 change
    assert ((ratio > 3) & (adv[:, None] < 0) & (mask > 0)).any()
    dual = grpo_loss_sum(logp, old, adv, mask, clip_eps=0.2, clip_ratio_c=3.0)
    capped = torch.where((adv[:, None] < 0) & (ratio > 3), -3.0 * adv[:, None].expand_as(ratio), plain)
    assert dual.item() == pytest.approx((capped * mask).sum().item(), rel=1e-6)


def test_the_run_stops_after_max_bad_steps_in_a_row():
    import pivot_train
    args = pivot_train.parse_args(["--max-bad-steps", "3"])
    assert pivot_train.check_skipped_updates(4, {"skipped_in_row": 2}, args) == 2
    with pytest.raises(SystemExit, match=r"step 5: 3 optimizer steps in a row skipped .*\(--max-bad-steps 3\)"):
        pivot_train.check_skipped_updates(5, {"skipped_in_row": 3}, args)


@pytest.mark.parametrize("flags, message", [
    (["--clip-ratio-c", "0.5"], "--clip-ratio-c must be 0 .* or above 1"),
    (["--adam-betas", "0.9"], "two numbers in"),
    (["--adam-betas", "0.9,1.5"], "two numbers in"),
    (["--adam-betas", "a,b"], "two numbers in"),
    (["--max-bad-steps", "0"], "--max-bad-steps must be at least 1"),
    (["--micro-batch-tokens", "-1"], "--micro-batch-tokens must be 0 or more"),
])
def test_safeguard_flags_are_checked(flags, message):
    import pivot_train
    with pytest.raises(SystemExit, match=message):
        pivot_train.check_config(pivot_train.parse_args(flags))


def test_rollout_correction_weights_by_hand():
    """Two responses of 3 and 2 tokens (the last position padding): per token min(pi_old / pi_rollout, 2);
    per sequence min(prod of the ratios, 2) on every token of the response."""
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -0.3, 0.0]])
    rollout = torch.tensor([[-1.5, -0.4, -2.0], [-1.2, -0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights, truncated = rollout_is_weights(old, rollout, mask, "token", 2.0)
    assert weights.flatten().tolist() == pytest.approx([math.exp(0.5), math.exp(-0.1), 1.0, 2.0, math.exp(-0.1), 0.0])
    assert truncated.tolist() == [[0, 0, 0], [1, 0, 0]]  # exp(1.1) = 3.0 > 2
    weights, truncated = rollout_is_weights(old, rollout, mask, "sequence", 2.0)
    first = math.exp(0.5 - 0.1)  # 1.49: kept
    assert weights.flatten().tolist() == pytest.approx([first] * 3 + [2.0, 2.0, 0.0])  # exp(1.0) = 2.7: truncated
    assert truncated.tolist() == [[0, 0, 0], [1, 1, 0]]


def test_rollout_correction_weights_the_policy_loss_not_the_kl_term():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask, adv, ref = torch.ones(1, 2), torch.tensor([0.5]), torch.tensor([[-1.2, -1.9]])
    weights = torch.tensor([[1.5, 0.25]])
    # against pi_old = logp itself (the ratio is 1): the loss is -w * A per token, plus the k3 term
    loss = grpo_loss_sum(logp, logp.detach(), adv, mask, 0.2, ref, 0.1, is_weights=weights)
    kl = sum(math.exp(d) - d - 1 for d in (-0.2, 0.1))
    assert loss.item() == pytest.approx(-0.5 * (1.5 + 0.25) + 0.1 * kl, rel=1e-6)
    loss.backward()
    # d/dlogp of -w * A * exp(logp - old) at logp = old is -w * A; the k3 term adds 0.1 * (1 - exp(ref - logp))
    expected = [-1.5 * 0.5 + 0.1 * (1 - math.exp(-0.2)), -0.25 * 0.5 + 0.1 * (1 - math.exp(0.1))]
    assert logp.grad[0].tolist() == pytest.approx(expected, rel=1e-6)
