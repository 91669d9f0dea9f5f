"""Prompt data: JSONL, one object per line with "prompt" and optionally "reference"."""
import json

import numpy as np


class DataError(ValueError):
    pass


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
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise DataError(f'{path}:{number}: needs a non-empty string "prompt" '
                            f'(and optionally "reference"), got {line.strip()[:80]!r}')
        if "reference" in record and not isinstance(record["reference"], str):
            raise DataError(f'{path}:{number}: "reference" must be a string')
        records.append({"prompt": record["prompt"], "reference": record.get("reference")})
    if not records:
        raise DataError(f"{path} holds no prompts; add lines like {{\"prompt\": \"12+30=\", \"reference\": \"42\"}}")
    return records


def step_prompts(n_records: int, step: int, per_step: int, seed: int) -> list[int]:
    """Indices of the prompts of `step`: consecutive slices of one seeded shuffle per epoch, so the
    order depends only on (seed, step) and a resumed run sees the same prompts."""
    orders, indices = {}, []
    for position in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(position, n_records)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n_records)
        indices.append(int(orders[epoch][offset]))
    return indices
