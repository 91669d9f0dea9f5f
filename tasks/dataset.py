"""Prompt data: JSONL (one object per line) or Parquet (one row per example), with a string "prompt" and
optionally "reference" and "rubric" (the rubric judge's per-example criteria).

Prompts are tokenized as the model expects them: through the tokenizer's chat template when it has one
(as one user message, with the generation prompt), as plain text otherwise. A prompt that does not fit
`--max-model-len` with its response (and its judge prompt with the response and critique) is left out
and counted, never cut.
"""
import json
from pathlib import Path

import numpy as np

FIELDS = ("prompt", "reference", "rubric")


class DataError(ValueError):
    pass


def load_records(path: str) -> list[dict]:
    """Every record of a .jsonl or .parquet file, checked."""
    if Path(path).suffix == ".parquet":
        return load_parquet(path)
    return load_jsonl(path)


def load_jsonl(path: str) -> list[dict]:
    """Every record of the file, checked; a bad line is reported with its number."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}; pass an existing JSONL file") from e
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not valid JSON ({e.msg}); each line must be one JSON object") from e
        records.append(_checked(record, f"{path}:{number}", line.strip()[:80]))
    return _nonempty(records, path)


def load_parquet(path: str) -> list[dict]:
    """Every row of the file, checked; a bad row is reported with its number (from 1)."""
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read Parquet file {path}: {e}; pass an existing Parquet file") from e
    if "prompt" not in table.column_names:
        raise DataError(f'{path}: needs a "prompt" column (and optionally "reference", "rubric"); '
                        f"it has {table.column_names}")
    columns = [c for c in FIELDS if c in table.column_names]
    rows = table.select(columns).to_pylist()
    return _nonempty([_checked(row, f"{path}: row {number}", str(row)[:80])
                      for number, row in enumerate(rows, start=1)], path)


def _checked(record, where: str, shown: str) -> dict:
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
        raise DataError(f'{where}: needs a non-empty string "prompt" '
                        f'(and optionally "reference", "rubric"), got {shown!r}')
    for field in ("reference", "rubric"):
        if record.get(field) is not None and not isinstance(record[field], str):
            raise DataError(f'{where}: "{field}" must be a string')
    return {field: record.get(field) for field in FIELDS}


def _nonempty(records: list[dict], path: str) -> list[dict]:
    if not records:
        raise DataError(f"{path} holds no prompts; add lines like {{\"prompt\": \"12+30=\", \"reference\": \"42\"}}")
    return records


def split_heldout(records: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out): a seeded `fraction` of the records, at least one, kept out of training."""
    if not 0 < fraction < 1:
        raise DataError(f"--eval-split {fraction}: give a fraction between 0 and 1, such as 0.1")
    held = max(1, round(fraction * len(records)))
    if held >= len(records):
        raise DataError(f"--eval-split {fraction} leaves no training prompts out of {len(records)}; lower it")
    order = np.random.default_rng([seed, 1]).permutation(len(records))
    return [records[i] for i in sorted(order[held:])], [records[i] for i in sorted(order[:held])]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as a prompt: a user message in the tokenizer's chat template, followed by the
    assistant's turn, when it has a template; the plain text (with the tokenizer's own special tokens)
    otherwise."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids  # the template already added them
    return tokenizer(text).input_ids


def fit_to_length(records: list[dict], tokenizer, judge_ids, *, max_model_len: int, response_tokens: int,
                  critique_tokens: int) -> tuple[list[dict], int]:
    """The records whose prompt fits with a full response, and whose judge prompt fits with a full response
    and critique, each given its "prompt_ids"; and how many were left out. `judge_ids(record)` is the
    judge prompt's ids with an empty response (the response adds about `response_tokens`)."""
    kept = []
    for record in records:
        ids = encode_prompt(tokenizer, record["prompt"])
        judged = len(judge_ids(record)) + response_tokens + critique_tokens
        if len(ids) + response_tokens <= max_model_len and judged <= max_model_len:
            kept.append({**record, "prompt_ids": ids})
    return kept, len(records) - len(kept)


def step_prompts(n_records: int, step: int, per_step: int, seed: int) -> list[int]:
    """Indices of the prompts of `step` when every step draws `per_step`: the step's slice of the stream."""
    return stream_prompts(n_records, step * per_step, per_step, seed)


def stream_prompts(n_records: int, start: int, count: int, seed: int) -> list[int]:
    """Indices of the `count` prompts from position `start` of the data stream: one seeded shuffle per
    epoch, one after another, so the order depends only on the seed and a resumed run that knows its
    position sees the same prompts."""
    orders, indices = {}, []
    for position in range(start, start + count):
        epoch, offset = divmod(position, n_records)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n_records)
        indices.append(int(orders[epoch][offset]))
    return indices
