"""What a run prints: its own lines, and of vLLM's output only what is not known to be harmless
(roles/logs.py). Pure: milliseconds. A whole run's console is checked in tests/e2e/test_run.py."""
import json
import logging
import os
import warnings

import pytest

import report
from roles import logs

LAYERWISE = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")


class Caught(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def caught(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    handler = Caught()
    LAYERWISE.addHandler(handler)
    logs.configure(verbose=False)
    yield handler.messages
    LAYERWISE.removeHandler(handler)
    logs.configure(verbose=False)


def test_known_reload_warnings_are_left_out_and_others_show(caught):
    LAYERWISE.warning("%s: Failed to load weights", "RotaryEmbedding")
    LAYERWISE.warning("%s: Failed to load weights", "ParallelLMHead")
    # the same logger, other layers or other words: real warnings, shown
    LAYERWISE.warning("%s: Failed to load weights", "QKVParallelLinear")
    LAYERWISE.warning("RotaryEmbedding: Failed to load weights for layer 3")
    LAYERWISE.error("ParallelLMHead: Failed to load weights")  # an error always shows
    assert caught == ["QKVParallelLinear: Failed to load weights",
                      "RotaryEmbedding: Failed to load weights for layer 3", "ParallelLMHead: Failed to load weights"]


def test_verbose_shows_them(caught):
    logs.configure(verbose=True)
    LAYERWISE.warning("RotaryEmbedding: Failed to load weights")
    assert caught == ["RotaryEmbedding: Failed to load weights"]


def test_vllm_logging_level_in_the_environment_shows_them(caught, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    LAYERWISE.warning("ParallelLMHead: Failed to load weights")
    assert caught == ["ParallelLMHead: Failed to load weights"] and logs.engine_log_level() is None


def test_warnings_before_the_flags_are_read_wait_for_them(caught):
    """vLLM warns as it is imported, before a run has read --verbose: held, then shown or dropped."""
    for verbose, shown in ((True, ["ParallelLMHead: Failed to load weights"]), (False, [])):
        logs._verbose = None
        LAYERWISE.warning("ParallelLMHead: Failed to load weights")
        assert caught == []
        logs.configure(verbose)
        assert caught == shown
        caught.clear()


def test_known_python_warnings_are_left_out_and_others_show(caught):
    logs.configure(verbose=True)
    logs.configure(verbose=False)  # a change of mind puts them back
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn("`torch.distributed.reduce_op` is deprecated, please use ReduceOp", FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]


def test_engine_start_keeps_every_stderr_line_but_the_known_ones(capfd):
    logs.configure(verbose=False)
    with logs.engine_start():
        os.write(2, b"[rank0]:[W1130 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory "
                    b"allocation on the NUMA nodes (0). Memory allocations will be strictly bound.\n")
        os.write(2, b"[rank0]:[W1130 other.cpp:12] Warning: something real (function f)\n")
    assert capfd.readouterr().err == "[rank0]:[W1130 other.cpp:12] Warning: something real (function f)\n"


def test_engine_start_lets_an_error_through(capfd):
    logs.configure(verbose=False)
    with pytest.raises(RuntimeError), logs.engine_start():
        os.write(2, b"the engine's last words\n")
        raise RuntimeError("engine failed")
    assert capfd.readouterr().err == "the engine's last words\n"


RECORDS = [
    {"step": 0, "eval_accuracy": 0.25, "judge_agreement": 1.0, "reward_mean": 0.25, "samples": 16,
     "samples_per_s": 8.0, "step_time_s": 2.0, "judge_agreement_train": 0.9, "judge_parse_failures": 0,
     "busy_s": {"rollout": 1.0, "judge": 2.0, "train": 0.5},
     "judge_confusion": {"judge_correct_ref_correct": 2, "judge_wrong_ref_wrong": 6}},
    {"step": 1, "reward_mean": 0.75, "samples": 16, "samples_per_s": 4.0, "step_time_s": 4.0,
     "judge_agreement_train": 1.0, "judge_parse_failures": 3, "busy_s": {"rollout": 1.5, "judge": 2.5, "train": 0.5}},
    {"step": 2, "eval_accuracy": 0.5, "judge_agreement": 0.875,
     "judge_confusion": {"judge_correct_ref_correct": 4, "judge_wrong_ref_wrong": 3, "judge_unparsed": 1}},
]


def test_step_and_eval_lines():
    assert report.eval_line(RECORDS[0]) == ("eval at step 0 | accuracy 0.250 | judge agreement 1.000 | "
                                            "8 held-out prompts")
    assert report.step_line(RECORDS[0], 2, 2.2, 2.2) == ("step 0/2 | reward 0.250 | 8.0 samples/s | 2.0 s | "
                                                         "busy s: rollout 1.0 judge 2.0 train 0.5 | elapsed 2s eta 2s")
    assert report.step_line(RECORDS[1], 2, 6.5, 0).endswith("| elapsed 6s eta 0s | judge outputs unparsed 3")
    sources = {**RECORDS[1], "reward_sources": {"judge": 0.5, "exact": 0.75, "overlong": -0.125}}
    assert report.step_line(sources, 2, 0, 0).startswith("step 1/2 | reward 0.750 (judge 0.500 exact 0.750 overlong -0.125) |")
    # the judge alone: the reward is its score, said once
    assert "(" not in report.step_line({**RECORDS[1], "reward_sources": {"judge": 0.75}}, 2, 0, 0)
    kept = {"prompts_drawn": 9, "dropped": 5, "trained": 4, "capped": False}
    assert report.step_line({**RECORDS[1], "filter_groups": kept}, 2, 0, 0).startswith(
        "step 1/2 | reward 0.750 | groups trained 4/9 | 4.0 samples/s |")
    capped = {"prompts_drawn": 64, "dropped": 61, "trained": 3, "capped": True}
    assert "| groups trained 3/64, at --filter-groups-max-prompts |" in report.step_line(
        {**RECORDS[1], "filter_groups": capped}, 2, 0, 0)


def test_avg_at_k_on_the_eval_line_in_the_summary_and_the_curves(tmp_path):
    sampled = [{**RECORDS[0], "eval_accuracy_avg@4": 0.1875}, RECORDS[1], {**RECORDS[2], "eval_accuracy_avg@4": 0.5}]
    assert report.eval_line(sampled[0]) == ("eval at step 0 | accuracy 0.250 | avg@4 0.188 | judge agreement 1.000 | "
                                            "8 held-out prompts")
    assert report.summary(tmp_path, sampled)[0].endswith(
        "eval accuracy 0.250 at step 0 -> 0.500 at step 2, avg@4 0.188 -> 0.500, judge agreement 0.875")
    assert report.avg_lines(sampled) == [("eval_accuracy_avg@4", "avg@4 (sampled answers)", "s--")]
    assert report.avg_lines(RECORDS) == []
    assert report.series(sampled, "eval_accuracy_avg@4") == ([0, 2], [0.1875, 0.5])
    report.draw_curves(tmp_path, sampled)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_elapsed_and_eta_clock():
    assert [report.clock(s) for s in (0, 42.4, 59.6, 187, 3599, 7500)] == ["0s", "42s", "1m00s", "3m07s", "59m59s",
                                                                       "2h05m"]


def test_summary_reads_the_whole_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (tmp_path / "checkpoints").mkdir()
    assert report.summary(tmp_path, RECORDS) == [
        "done: 2 steps, 32 samples in 6 s of steps (5.3 samples/s); eval accuracy 0.250 at step 0 -> 0.500 at "
        "step 2, judge agreement 0.875",
        f"files in {tmp_path}: checkpoints/ metrics.jsonl"]


def test_curves_plot_each_metric_by_step(tmp_path):
    assert report.series(RECORDS, "reward_mean") == ([0, 1], [0.25, 0.75])
    assert report.series(RECORDS, "reward_mean/5") == ([0, 1], [0.25, 0.5])  # mean of the steps so far
    assert report.series(RECORDS, "eval_accuracy") == ([0, 2], [0.25, 0.5])
    assert report.series(RECORDS, "judge_agreement") == ([0, 2], [1.0, 0.875])
    assert report.series(RECORDS, "samples_per_s") == ([0, 1], [8.0, 4.0])
    assert report.series([{"step": 3, "reward_sources": {"exact": 0.5}}], "reward_sources.exact") == ([3], [0.5])
    assert report.source_lines(RECORDS) == []
    assert [m for m, _, _ in report.source_lines([{"reward_sources": {"judge": 1, "exact": 0}}])] == [
        "reward_sources.judge", "reward_sources.exact"]
    plotted = {metric for _, _, lines, _ in report.PANELS for metric, _, _ in lines}
    assert {"reward_mean", "eval_accuracy", "judge_agreement", "samples_per_s"} <= plotted
    report.draw_curves(tmp_path, RECORDS)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
