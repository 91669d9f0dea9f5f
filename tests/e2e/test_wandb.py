"""--wandb-project: a two-step run logs to Weights & Biases offline (no network, every file in the test's
temporary folder), and the run's .wandb file holds, for each step, the scalars metrics.jsonl holds."""
import json
import struct
import zlib

from conftest import ROOT, metrics, torchrun

# wandb's .wandb file is a LevelDB log: a 7-byte file header, then 32 KiB blocks of chunks, each a 7-byte
# header (CRC-32 of its type and data, data length, type) and its data; a record is one FULL chunk or a
# FIRST, MIDDLE.., LAST run. wandb 0.30 reads it in wandb-core (Go) alone; its records are the protobuf
# messages of wandb.proto.wandb_internal_pb2.
BLOCK, HEADER, FULL, LAST = 32768, 7, 1, 4


def records(path):
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    at, parts = HEADER, []
    while at + HEADER <= len(data):
        if BLOCK - at % BLOCK < HEADER:  # a block's tail too short for a chunk header is padding
            at += BLOCK - at % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[at:at + HEADER])
        chunk = data[at + HEADER:at + HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path} at byte {at}: not a chunk"
        at += HEADER + length
        parts.append(chunk)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def history(path) -> dict[int, dict]:
    """Each wandb.log call's values by its step, wandb's own keys (`_runtime`, `_timestamp`) left out."""
    logged = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            logged[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
    return logged


def numbers(record: dict, prefix: str = "") -> dict:
    """A metrics record's numbers by their path ("storage/policy/bytes"), a list by its length."""
    found = {}
    for key, value in record.items():
        if isinstance(value, dict):
            found.update(numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, list):
            found[prefix + key] = len(value)
        elif isinstance(value, (int, float)) and key != "step":
            found[prefix + key] = value
    return found


def test_wandb_logs_each_steps_metrics(tmp_path):
    out, store = tmp_path / "run", tmp_path / "wandb"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": store, **{f"WANDB_{kind.upper()}_DIR": store / kind
                                                         for kind in ("cache", "config", "data", "artifact")}}
    torchrun(ROOT / "pivot_train.py", "--steps", 2, "--prompts-per-step", 4, "--group-size", 4, "--eval-every", 100,
             "--eval-prompts", 8, "--wandb-project", "pivot-test", "--out", out,
             env={key: str(value) for key, value in env.items()})
    [log] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    logged = history(log)
    records = metrics(out)
    assert sorted(logged) == [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert logged[r["step"]] == numbers(r), r["step"]
    assert "reward_mean" in logged[1] and "eval_accuracy" in logged[2] and "loss" in logged[0]
