"""The run's one estimate of the training speed (planner.TrainSpeed): a pivot placement's is the one its
planner plans with; early train rounds (StepQueues) and updates (Placement.learn) move it, and the
planner's state carries it across a resume."""
import json
from dataclasses import replace

import pytest

from algorithm import Algorithm
from planner import TrainSpeed
from roles.rollout import Sample
from shifting.placement import Placement, PlacementOptions
from shifting.scheduler import NO_EARLY, Report, SamplingOptions, StepQueues

G = 2
PLACEMENT = PlacementOptions(placement="pivot", split=None, max_staleness=1, force_shifts=None, force_shift_rate=0.2,
                             minibatches=1, max_seqs=8, max_response_tokens=8, max_critique_tokens=8, seed=0)
SAMPLING = SamplingOptions(group_size=G, seed=0, temperature=1.0, max_response_tokens=8, workload="task")
PROMPTS = [{"prompt": f"{p}+1=", "prompt_ids": [3, 4 + p]} for p in range(2)]
POOL = [Sample(p, g, [3], [5], [-1.0], "stop", reward=float(g)) for p in range(2) for g in range(G)]


def test_each_measurement_moves_the_estimate_halfway():
    speed = TrainSpeed()
    assert speed.per_s == TrainSpeed.PRIOR
    speed.observe(1e3)
    speed.observe(3e3)
    assert speed.per_s == 0.5 * (0.5 * TrainSpeed.PRIOR + 0.5 * 1e3) + 0.5 * 3e3


def test_one_estimate_from_early_training_to_the_planner_and_through_a_checkpoint():
    placement = Placement(PLACEMENT, world_size=2)
    queues = StepQueues(PROMPTS, step=1, sampling=SAMPLING, algo=Algorithm(), early_train=True, train_pool=POOL,
                        train_speed=placement.train_speed)
    # two groups of two samples of 2 tokens each, in 0.1 s on one train rank: 80 tokens per second
    queues.ingest([Report("train", trained={**NO_EARLY, "groups": [(0, 0), (0, 1)]}, train_s=0.1)], 0.0)
    assert placement.train_speed.per_s == pytest.approx(0.5 * TrainSpeed.PRIOR + 0.5 * 80)
    assert placement.planner.measured_speeds().train_per_s == placement.train_speed.per_s
    placement.learn(POOL, [], {"train_tokens_per_s": 100.0})
    assert placement.train_speed.per_s == pytest.approx(0.5 * (0.5 * TrainSpeed.PRIOR + 0.5 * 80) + 0.5 * 100)

    resumed = Placement(PLACEMENT, world_size=2)
    resumed.load_state(json.loads(json.dumps(placement.state())))  # as the checkpoint keeps it
    assert resumed.train_speed.per_s == placement.train_speed.per_s
    assert resumed.planner.measured_speeds().train_per_s == placement.train_speed.per_s


def test_a_placement_without_planner_keeps_its_estimate_from_early_training_alone():
    placement = Placement(replace(PLACEMENT, placement="colocated"), world_size=2)
    placement.learn(POOL, [], {"train_tokens_per_s": 100.0})
    assert placement.state() is None and placement.train_speed.per_s == TrainSpeed.PRIOR
