"""Bring-your-own models: Qwen2, Llama, Qwen3 and Qwen3-MoE built from configs, as policy and as judge, in
two-step runs (their weights reloaded into vLLM and exported, one architecture after another:
tests/distributed/test_arch_reload.py)."""
import json

import pytest

from conftest import ROOT, torchrun


def write_data(path, n, long_prompts=0):
    """Addition prompts with references and rubrics; `long_prompts` of them too long for --max-model-len 256."""
    rows = [{"prompt": f"{i}+{2 * i}=", "reference": str(3 * i), "rubric": "the answer is the sum"}
            for i in range(1, n + 1)]
    rows += [{"prompt": "1+" * 200 + "1=", "reference": "201", "rubric": "the answer is the sum"}] * long_prompts
    if str(path).endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def two_steps(tmp_path, policy, judge, *extra):
    out = tmp_path / "run"
    proc = torchrun(ROOT / "pivot_train.py", "--policy", policy, "--judge-model", judge, "--steps", 2,
                    "--prompts-per-step", 2, "--group-size", 2, "--max-response-tokens", 8,
                    "--max-critique-tokens", 8, "--max-model-len", 256, "--eval-every", 2, "--eval-prompts", 2,
                    "--kv-cache-mb", 8, "--out", out, *extra)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[:2]:
        assert r["samples"] == 4 and r["judge_requests"] == 4
        # 8 critique tokens of a character tokenizer cannot spell a verdict line ("verdict: wrong" has 14),
        # and the random judges (greedy, seeded) write no score line: every output is a counted parse
        # failure, scored 0
        assert r["judge_parse_failures"] == r["samples"] and r["reward_sources"]["judge"] == 0.0
    info = json.loads((out / "run_info.json").read_text())
    return proc.stdout, records, info, out


def tensorboard_tags(out) -> set[str]:
    """Scalar tags in the run directory's event files (TFRecord framing, tensorboardX's Event proto)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event
    tags = set()
    for path in out.glob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            tags |= {v.tag for v in event.summary.value}
            at += 12 + length + 4
    return tags


def test_moe_policy_with_llama_judge_jsonl_heldout_split(arch_models, tmp_path):
    data = write_data(tmp_path / "train.jsonl", 12, long_prompts=1)
    stdout, records, info, out = two_steps(tmp_path, arch_models["qwen3_moe"], arch_models["llama"],
                                           "--data", data, "--eval-split", 0.25)
    # 13 records, 3 held out (seeded; 2 evaluated, --eval-prompts); the one over the length limit is
    # counted and left out, not cut
    assert info["train_prompts"] + info["train_prompts_too_long"] == 10 and info["eval_prompts"] == 2
    assert info["train_prompts_too_long"] + info["eval_prompts_too_long"] == 1
    assert "left out: " in stdout
    assert {"reward_mean", "samples_per_s", "busy_s/train", "eval_accuracy"} <= tensorboard_tags(out)


def test_qwen2_policy_with_moe_rubric_judge_parquet(arch_models, tmp_path):
    train = write_data(tmp_path / "train.parquet", 8)
    heldout = write_data(tmp_path / "heldout.parquet", 2)
    _, _, info, _ = two_steps(tmp_path, arch_models["qwen2"], arch_models["qwen3_moe"], "--data", train,
                              "--eval-data", heldout, "--judge-kind", "rubric",
                              "--judge-template", ROOT / "tasks/judge_rubric.txt")
    assert info["train_prompts"] == 8 and info["eval_prompts"] == 2


def test_chat_template_policy_qwen3_with_qwen2_judge_and_rule_rewards(arch_models, tmp_path):
    """With rule sources beside the judge: each sample's reward is the sum of its scores times their
    coefficients, each source's step mean is in the metrics and the console line."""
    data = write_data(tmp_path / "train.jsonl", 8)
    stdout, records, info, out = two_steps(tmp_path, arch_models["qwen3"], arch_models["qwen2"], "--data", data,
                                           "--eval-split", 0.25, "--reward", "judge=1,exact=2,overlong=0.5",
                                           "--overlong-buffer", 4)
    assert info["policy_chat_template"] and not info["judge_chat_template"]
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for row in rows:
        s = row["scores"]
        assert row["reward"] == pytest.approx(s["judge"] + 2 * s["exact"] + 0.5 * s["overlong"])
        assert s["overlong"] == min(0.0, (8 - 4 - row["response_tokens"]) / 4)
        assert s["exact"] == float(row["response"].rsplit(">", 1)[-1].strip() == row["reference"] and ">" in row["response"])
    for r in records[:2]:
        step = [x for x in rows if x["step"] == r["step"]]
        for name in ("judge", "exact", "overlong"):
            assert r["reward_sources"][name] == pytest.approx(sum(x["scores"][name] for x in step) / len(step))
        assert f"(judge 0.000 exact {r['reward_sources']['exact']:.3f} overlong " in stdout
