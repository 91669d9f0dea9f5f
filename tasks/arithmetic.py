"""Multi-digit addition, the built-in task.

A prompt is "347+85=" and a response is a worked solution, one column at a time from the right, then
the final answer after ">":

    7+5=12,4+8+1=13,3+0+1=4>432

Each column shows both digits (0 where an operand has run out), the carry as "+1" when one comes in,
and the column sum. The answer is the last digit of every column sum, read from the left, with a
leading "1" when the last column carries out.

The classic learner's mistake is to forget a carry. `solution` drops each carry independently with a
given probability and keeps the answer consistent with the (possibly wrong) steps. The shipped policy
is trained on such solutions with a high drop probability, so it starts weak: greedy decoding forgets
every carry, while sampling still keeps some of them, so a GRPO group holds both correct and wrong
answers and RL can learn to keep the carry. Everything here is pure Python so that the trainer, the
judge and the tests can use it without torch.
"""

import itertools
import json
import random

ANSWER_MARKER = ">"
# Every character a response or a critique can hold; the tokenizer adds the judge template's own.
TASK_CHARS = "0123456789+=,>; gotnevrdicwl:"


def make_operand(rng: random.Random, digits: int) -> int:
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_problem(rng: random.Random, min_digits: int = 1, max_digits: int = 4) -> dict:
    """A sum of two operands whose digit counts are drawn independently, so answer lengths vary."""
    a = make_operand(rng, rng.randint(min_digits, max_digits))
    b = make_operand(rng, rng.randint(min_digits, max_digits))
    return {"prompt": f"{a}+{b}=", "reference": str(a + b)}


def parse_prompt(prompt: str) -> tuple[int, int]:
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def solution(a: int, b: int, drop_carry_prob: float = 0.0, rng: random.Random | None = None) -> str:
    """The worked response for a+b; each carry (the final one included) is forgotten with drop_carry_prob."""
    rng = rng or random.Random(0)
    da, db = str(a)[::-1], str(b)[::-1]
    steps, answer_digits, carry = [], [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        total = x + y + carry
        steps.append(f"{x}+{y}+1={total}" if carry else f"{x}+{y}={total}")
        answer_digits.append(str(total % 10))
        carry = int(total >= 10 and rng.random() >= drop_carry_prob)
    if carry:
        answer_digits.append("1")
    return ",".join(steps) + ANSWER_MARKER + "".join(reversed(answer_digits))


def extract_answer(response: str) -> str | None:
    """The digits after the last answer marker, or None when there is no well-formed answer."""
    if ANSWER_MARKER not in response:
        return None
    answer = response.rsplit(ANSWER_MARKER, 1)[1].strip()
    return answer if answer.isdigit() else None


def is_correct(response: str, reference: str) -> bool:
    return extract_answer(response) == reference


def critique(response: str, reference: str) -> str:
    """What the judge is trained to write: the response's final answer, the gold answer (the data's
    reference, shown in the judge's prompt), the two compared digit by digit from the left ("s" same,
    "d" different, "n" where one has run out), then the verdict:

        got 322; gold 432; 34d 23d 22s; verdict: wrong

    A judge that recomputed the sum itself was tried first: RL found responses whose odd layout (an
    extra column, a wrong column sum) led the tiny judge's own arithmetic astray, so the policy's
    reward rose while its accuracy fell. A judge that wrote both answers and then its verdict was
    fooled next: it had to compare two numbers in one token. Digit pairs make each comparison local,
    and the verdict is "wrong" exactly when some pair says "d"."""
    got = extract_answer(response)
    pairs = " ".join(f"{a}{b}{'s' if a == b else 'd'}"
                     for a, b in itertools.zip_longest(got or "", reference, fillvalue="n"))
    verdict = "correct" if got == reference else "wrong"
    return f"got {got or 'none'}; gold {reference}; {pairs}; verdict: {verdict}"


def write_jsonl(path: str, n: int, seed: int, min_digits: int = 1, max_digits: int = 4,
                exclude: set[str] = frozenset()) -> set[str]:
    """Write n distinct problems whose prompts are not in `exclude`; returns the prompts written."""
    rng = random.Random(seed)
    problems: dict[str, dict] = {}
    while len(problems) < n:
        problem = make_problem(rng, min_digits, max_digits)
        if problem["prompt"] not in exclude:
            problems.setdefault(problem["prompt"], problem)
    with open(path, "w") as f:
        for problem in problems.values():
            f.write(json.dumps(problem) + "\n")
    return set(problems)
