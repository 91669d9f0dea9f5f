"""Build the built-in task's data and its two tiny models, deterministically from a seed.

    python -m tasks.build_models [--seed 0]

Writes tasks/data/arith_{train,eval}.jsonl, then two Qwen2 models with a shared character-level
tokenizer, each pre-trained from scratch with plain PyTorch on CPU:

- models/arith-policy: prompt -> worked response, trained on solutions that forget each carry with
  probability --drop-carry-prob, so it starts weak (see tasks/arithmetic.py) and GRPO has room to improve.
- models/arith-genrm: judge prompt (tasks/judge_arith.txt filled with the prompt, a response and the gold
  answer) -> critique quoting the response's answer and the gold one, ending in "verdict: correct" or
  "verdict: wrong". It starts from the policy's weights and learns from right, wrong, near-miss and
  malformed responses. `--only-judge` rebuilds it alone, over the shipped policy.

Ends by printing the policy's greedy and sampled accuracy on the eval split and the judge's agreement
with the true check on responses sampled from the policy. Takes about 12 minutes on 2 idle CPU cores.
"""

import argparse
import os
import random
import re
import string
import time

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from roles import Role
from tasks import arithmetic
from tasks.dataset import load_jsonl
from tinymodel import qwen2_char_tokenizer

TASK_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TASK_DIR)
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]  # ids 0, 1, 2
VERDICT_RE = re.compile(r"verdict:\s*(correct|wrong)")
MAX_RESPONSE_TOKENS = 48
MAX_CRITIQUE_TOKENS = 96


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    # data
    p.add_argument("--train-size", type=int, default=5000)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--min-digits", type=int, default=1)
    p.add_argument("--max-digits", type=int, default=4)
    # models
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--drop-carry-prob", type=float, default=0.6)
    # optimisation
    p.add_argument("--policy-steps", type=int, default=800)
    p.add_argument("--judge-steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only-judge", action="store_true",
                   help="keep models/arith-policy and rebuild the judge alone (as a full build would)")
    # output
    p.add_argument("--template", default=os.path.join(TASK_DIR, "judge_arith.txt"))
    p.add_argument("--data-dir", default=os.path.join(TASK_DIR, "data"))
    p.add_argument("--models-dir", default=os.path.join(REPO_DIR, "models"))
    return p.parse_args()


def build_tokenizer(template: str):
    """One token per character: the task's characters plus the literal text of the judge template."""
    literal = "".join(text for text, _, _, _ in string.Formatter().parse(template))
    chars = sorted(set(arithmetic.TASK_CHARS) | set(literal))
    return qwen2_char_tokenizer(SPECIAL_TOKENS, chars, [], unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")


def build_model(tokenizer, hidden_size: int, layers: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 64, num_key_value_heads=hidden_size // 64,  # vLLM-CPU wants head_dim 64
        max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def sample_problem(rng: random.Random, args, held_out: set[str]) -> tuple[str, int, int]:
    while True:
        prompt = arithmetic.make_problem(rng, args.min_digits, args.max_digits)["prompt"]
        if prompt not in held_out:
            return (prompt, *arithmetic.parse_prompt(prompt))


def policy_example(rng, args, held_out, template) -> tuple[str, str]:
    prompt, a, b = sample_problem(rng, args, held_out)
    return prompt, arithmetic.solution(a, b, args.drop_carry_prob, rng)


def corrupt(rng: random.Random, response: str) -> str:
    """A malformed response, so the judge also sees what a drifting policy may write: truncated, a
    character replaced, inserted or deleted anywhere (the answer included), or a column repeated."""
    kind = rng.randrange(5)
    if kind == 0 or len(response) < 2:
        return response[:rng.randrange(len(response) + 1)]
    i = rng.randrange(len(response))
    char = rng.choice("0123456789+=,>")
    if kind == 1:
        return response[:i] + char + response[i + 1:]
    if kind == 2:
        return response[:i] + char + response[i:]
    if kind == 3:
        return response[:i] + response[i + 1:]
    steps = response.split(",")
    j = rng.randrange(len(steps))
    return ",".join(steps[:j + 1] + steps[j:])


def near_miss(rng: random.Random, response: str, reference: str) -> str:
    """The worked steps with a final answer one edit away from the reference: the hardest wrong
    answers to tell from right ones."""
    digits = list(reference)
    i, kind = rng.randrange(len(digits)), rng.randrange(3)
    if kind == 0:
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    elif kind == 1:
        digits.insert(i, rng.choice("0123456789"))
    elif len(digits) > 1:
        del digits[i]
    else:
        digits.append(rng.choice("0123456789"))
    return response.rsplit(arithmetic.ANSWER_MARKER, 1)[0] + arithmetic.ANSWER_MARKER + "".join(digits)


def scrambled(rng: random.Random, a: int, b: int) -> str:
    """Steps that need not add up, then the right answer, a near miss or any number: the verdict must
    follow the final answer alone, whatever the steps look like."""
    steps = ",".join(f"{rng.randrange(10)}+{rng.randrange(10)}{'+1' * rng.randrange(2)}={rng.randrange(20)}"
                     for _ in range(rng.randint(1, 5)))
    answer, kind = str(a + b), rng.random()
    if kind < 0.4:
        return f"{steps}>{answer}"
    if kind < 0.7:
        return near_miss(rng, f"{steps}>", answer)
    return f"{steps}>{rng.randrange(10 ** rng.randint(1, 5))}"


def judged_response(rng: random.Random, a: int, b: int) -> str:
    """A response for the judge to learn from: right, policy-like wrong, a near miss, scrambled steps,
    or malformed."""
    kind = rng.random()
    if kind < 0.25:
        return arithmetic.solution(a, b)
    response = arithmetic.solution(a, b, rng.uniform(0.2, 1.0), rng)
    if kind < 0.45:
        return response
    if kind < 0.6:
        return near_miss(rng, arithmetic.solution(a, b), str(a + b))
    if kind < 0.85:
        return scrambled(rng, a, b)
    return corrupt(rng, response if rng.random() < 0.5 else arithmetic.solution(a, b))


def judge_example(rng, args, held_out, template) -> tuple[str, str]:
    prompt, a, b = sample_problem(rng, args, held_out)
    response, reference = judged_response(rng, a, b), str(a + b)
    return (template.format(prompt=prompt, response=response, reference=reference),
            arithmetic.critique(response, reference))


def make_batch(tokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels; the loss covers the target and its EOS, never the prompt."""
    rows = []
    for prompt, target in pairs:
        p, t = tokenizer.encode(prompt), tokenizer.encode(target) + [tokenizer.eos_token_id]
        rows.append((p + t, [-100] * len(p) + t))
    width = max(len(ids) for ids, _ in rows)
    ids = [ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in rows]
    labels = [labels + [-100] * (width - len(labels)) for _, labels in rows]
    return torch.tensor(ids), torch.tensor(labels)


def train(model, tokenizer, example, steps: int, args, rng, held_out, template, name: str):
    """`example(rng, args, held_out, template)` returns one fresh (prompt, target) pair."""
    # Right padding needs no attention mask: causal attention never lets a real token see a pad.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * (1 - s / steps)))
    model.train()
    start = time.time()
    for step in range(steps):
        pairs = [example(rng, args, held_out, template) for _ in range(args.batch_size)]
        ids, labels = make_batch(tokenizer, pairs)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"{name} step {step:5d} loss {loss.item():.4f} {time.time() - start:6.0f}s", flush=True)
    model.eval()


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], temperature: float, max_new_tokens: int,
             batch_size: int = 200) -> list[str]:
    sampling = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None) if temperature > 0 \
        else dict(do_sample=False)
    texts = []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(**enc, max_new_tokens=max_new_tokens, **sampling)
        texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts


def accuracy(responses: list[str], references: list[str]) -> float:
    return sum(map(arithmetic.is_correct, responses, references)) / len(references)


def parse_verdict(critique: str) -> str | None:
    matches = VERDICT_RE.findall(critique)
    return matches[-1] if matches else None


def judge_agreement(judge, tokenizer, template, prompts, responses, references):
    """Fraction of verdicts equal to the true check, and counts by (truth, verdict)."""
    judge_prompts = [template.format(prompt=p, response=r, reference=ref)
                     for p, r, ref in zip(prompts, responses, references)]
    verdicts = [parse_verdict(c) for c in generate(judge, tokenizer, judge_prompts, 0.0, MAX_CRITIQUE_TOKENS)]
    truths = ["correct" if arithmetic.is_correct(r, ref) else "wrong" for r, ref in zip(responses, references)]
    confusion = {(t, v): 0 for t in ("correct", "wrong") for v in ("correct", "wrong", None)}
    for truth, verdict in zip(truths, verdicts):
        confusion[truth, verdict] += 1
    agreement = sum(t == v for t, v in zip(truths, verdicts)) / len(truths)
    return agreement, confusion


def save(model, tokenizer, path: str):
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    print(f"saved {path} ({model.num_parameters():,} parameters)")


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    with open(args.template) as f:
        template = f.read()

    os.makedirs(args.data_dir, exist_ok=True)
    eval_path = os.path.join(args.data_dir, "arith_eval.jsonl")
    held_out = arithmetic.write_jsonl(eval_path, args.eval_size, args.seed + 1, args.min_digits, args.max_digits)
    arithmetic.write_jsonl(os.path.join(args.data_dir, "arith_train.jsonl"), args.train_size, args.seed + 2,
                           args.min_digits, args.max_digits, exclude=held_out)
    eval_set = load_jsonl(eval_path)
    prompts, references = [p["prompt"] for p in eval_set], [p["reference"] for p in eval_set]

    tokenizer = build_tokenizer(template)
    policy_dir = os.path.join(args.models_dir, "arith-policy")
    if args.only_judge:
        policy = Qwen2ForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    else:
        policy = build_model(tokenizer, args.hidden_size, args.layers)
        train(policy, tokenizer, policy_example, args.policy_steps, args, rng, held_out, template, "policy")
        save(policy, tokenizer, policy_dir)

    # The judge's own seeds: --only-judge rebuilds exactly the judge a full build makes.
    torch.manual_seed(args.seed + 3)
    judge_rng = random.Random(args.seed + 3)
    judge = build_model(tokenizer, args.hidden_size, args.layers)
    judge.load_state_dict(policy.state_dict())
    train(judge, tokenizer, judge_example, args.judge_steps, args, judge_rng, held_out, template, Role.JUDGE)
    save(judge, tokenizer, os.path.join(args.models_dir, "arith-genrm"))

    greedy = generate(policy, tokenizer, prompts, 0.0, MAX_RESPONSE_TOKENS)
    samples_per_prompt = 4
    sample_prompts = [p for p in prompts for _ in range(samples_per_prompt)]
    sample_refs = [r for r in references for _ in range(samples_per_prompt)]
    sampled = generate(policy, tokenizer, sample_prompts, 1.0, MAX_RESPONSE_TOKENS)
    agreement, confusion = judge_agreement(judge, tokenizer, template, sample_prompts, sampled, sample_refs)
    print(f"policy greedy accuracy on eval:      {accuracy(greedy, references):.3f}")
    print(f"policy sampled (T=1) accuracy:       {accuracy(sampled, sample_refs):.3f}")
    print(f"judge agreement on policy samples:   {agreement:.3f} ({len(sampled)} responses)")
    for (truth, verdict), count in confusion.items():
        print(f"  truth {truth:7s} verdict {str(verdict):7s} {count:5d}")


if __name__ == "__main__":
    main()
