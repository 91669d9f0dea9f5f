"""--max-staleness K > 0, the partial rollout as rank 0's StepQueues sees it, driven by hand: once the
train ranks make the update, it is published at that round's start, the next step's prompts
join the queue behind this step's, what of them finishes is kept apart from this step's samples, and as
the step ends the rest (queued, and exported from the engines) is carried into the next step's queues."""
from algorithm import Algorithm
from roles.engine import Request
from roles.judge import Verdict
from roles.rollout import Sample
from shifting.book import IN_FLIGHT
from shifting.scheduler import NO_EARLY, Report, SamplingOptions, StepQueues

G = 2
SAMPLING = SamplingOptions(group_size=G, seed=0, temperature=1.0, max_response_tokens=8, workload="task")
PROMPTS = [{"prompt": f"{p}+1=", "prompt_ids": [3, 4 + p]} for p in range(2)]
AHEAD = [{"prompt": f"{p}+2=", "prompt_ids": [5, 4 + p]} for p in range(2)]
POOL = [Sample(p, g, [3], [5], [-1.0], "stop", reward=float(g)) for p in range(2) for g in range(G)]


def take(queues: StepQueues, request: Request) -> None:
    """A queued request out of the book's queue onto an engine (as dispatch sends it)."""
    i = queues.number(request)
    queues.book.queue[request.role].remove(i)
    queues.book.phase[i] = IN_FLIGHT[request.role]


def finish(queues: StepQueues, request: Request, reward: float = 1.0) -> None:
    """One request done on an engine: a rollout becomes a sample with its judge request, a critique a verdict."""
    take(queues, request)
    if request.role == "rollout":
        sample = Sample(*request.key, request.prompt_ids, [6], [-0.5], "stop", versions=[(0, queues.version)],
                        step=request.step)
        judging = Request("judge", request.key, [7], 8, 0.0, step=request.step)
        queues.ingest([Report("rollout", responses=[(sample, judging)])], 0.0)
    else:
        verdict = Verdict(request.key, "", 1, 1, reward, False, True, 0, step=request.step)
        queues.ingest([Report("judge", verdicts=[verdict])], 0.0)


def test_the_update_made_the_next_step_begins_and_what_is_left_of_it_carries_over():
    queues = StepQueues(PROMPTS, step=3, sampling=SAMPLING, algo=Algorithm(), early_train=True, train_pool=POOL, version=1, ahead=AHEAD)
    assert not queues.publish_due(making=False)  # nothing made yet
    queues.ingest([Report("train", trained={**NO_EARLY, "groups": [(0, 0), (0, 1)]}, train_s=0.1)], 0.0)
    assert queues.update_due() and not queues.publish_due(making=False)
    assert queues.publish_due(making=True)  # ordered with the update the train ranks make first
    queues.ingest([Report("train", update={"loss": 0.0})], 0.0)
    assert queues.publish_due(making=False)
    assert queues.publish() == 2 and not queues.publish_due(making=False)  # once
    assert [(r.step, r.key) for r in queues.queued("rollout")] == \
        [(3, (0, 0)), (3, (0, 1)), (3, (1, 0)), (3, (1, 1)), (4, (0, 0)), (4, (0, 1)), (4, (1, 0)), (4, (1, 1))]
    # the next step's first sample and its verdict go to its own queues, not this step's
    first = queues.queued("rollout")[4]
    finish(queues, first)
    judging = next(r for r in queues.queued("judge") if r.step == 4)
    finish(queues, judging, reward=0.0)
    assert (4, 0, 0) in queues.ahead.samples and (4, 0, 0) not in queues.samples and queues.ahead.book.judged == 1
    for request in [r for r in queues.queued("rollout") if r.step == 3]:
        finish(queues, request)
    while queues.queued("judge"):
        finish(queues, queues.queued("judge")[0])
    assert queues.done() and queues.ahead.book.judged == 1 and set(queues.ahead.samples) == {(4, 0, 0)}
    # as the step ends, an engine exports the next step's sequence it was writing: it goes first
    running = queues.queued("rollout")[0]
    take(queues, running)
    exported = Request(running.role, running.key, running.prompt_ids, running.max_tokens, running.temperature,
                       running.seed, generated=[9, 9], logprobs=[-0.1, -0.2], step=4, versions=[(0, 2)])
    carried = queues.carry([exported])
    assert carried is queues.ahead and carried.migrated == 1
    assert [(r.key, r.generated) for r in carried.queued("rollout")] == [((0, 1), [9, 9]), ((1, 0), []), ((1, 1), [])]
    # the next step takes it up: the same queues, samples and verdicts, and its own train pool
    nxt = StepQueues(AHEAD, step=4, sampling=SAMPLING, algo=Algorithm(), early_train=True, train_pool=POOL, version=2, carried=carried)
    assert nxt.book is carried.book and nxt.samples == {(4, 0, 0): carried.samples[(4, 0, 0)]}
    assert nxt.book.judged == 1 and nxt.book.phase[0] == 4 and nxt.judge_runs == 1 and not nxt.done()


def test_without_a_step_to_run_ahead_into_the_update_waits_for_the_step_end():
    """A step whose update ends in a checkpoint (no `ahead`) publishes nothing during the rollout."""
    queues = StepQueues(PROMPTS, step=3, sampling=SAMPLING, algo=Algorithm(), early_train=True, train_pool=POOL, version=1)
    queues.ingest([Report("train", trained={**NO_EARLY, "groups": [(0, 0), (0, 1)]}, train_s=0.1)], 0.0)
    queues.ingest([Report("train", update={"loss": 0.0})], 0.0)
    assert queues.update is not None and not queues.publish_due(making=False)
    assert queues.carry([]) is None


def test_a_step_ends_with_its_slowest_group_out_which_goes_on_in_the_next_and_trains_there():
    """--updates ready: once the next step has begun and at most half of this step's groups are out, the
    step ends; the group still out (its response exported mid-sequence) moves into the next step first, as
    the book numbers it, with its request, its samples so far and its prompt's step; the next step cannot
    end before that group is judged, and its samples come first in the next step's."""
    queues = StepQueues(PROMPTS, step=3, sampling=SAMPLING, algo=Algorithm(), early_train=True, train_pool=POOL,
                        version=1, ahead=AHEAD, spill=True)
    queues.ingest([Report("train", trained={**NO_EARLY, "groups": [(0, 0), (0, 1)]}, train_s=0.1)], 0.0)
    queues.ingest([Report("train", update={"loss": 0.0})], 0.0)
    own = queues.queued("rollout")
    for request in own[:3]:  # group 0 whole, group 1's first response
        finish(queues, request)
    judging = queues.queued("judge")
    for request in judging[:2]:
        finish(queues, request)
    assert not queues.done()  # no next step begun: the step waits for its every group
    queues.publish()
    assert queues.done() and not queues.book.done()  # group 1 out, half of the step's groups
    take(queues, judging[2])  # group 1's first critique on an engine, its second response too
    running = own[3]
    take(queues, running)
    exported = [judging[2], Request(running.role, running.key, running.prompt_ids, running.max_tokens,
                                    running.temperature, running.seed, generated=[9], logprobs=[-0.1], step=3,
                                    versions=[(0, 1)])]
    carried = queues.carry(exported)
    assert queues.spilled == 1 and [s.id for s in queues.ordered_samples()] == [(3, 0, 0), (3, 0, 1)]
    assert carried.book.carried_in == 1 and carried.numbers[(3, 1, 0)] == 0 and carried.numbers[(4, 0, 0)] == 2
    assert [(r.step, r.key) for r in carried.queued("judge")] == [(3, (1, 0))]
    assert [(r.step, r.key, r.generated) for r in carried.queued("rollout")][:1] == [(3, (1, 1), [9])]
    assert set(carried.samples) == {(3, 1, 0)}
    nxt = StepQueues(AHEAD, step=4, sampling=SAMPLING, algo=Algorithm(), early_train=True, train_pool=POOL,
                     version=2, carried=carried, spill=True)
    for request in nxt.queued("rollout"):
        if request.step == 4:
            finish(nxt, request)
    while any(r.step == 4 for r in nxt.queued("judge")):
        finish(nxt, next(r for r in nxt.queued("judge") if r.step == 4))
    assert not nxt.done()  # its own groups judged, the one carried in (at the bound) is not
    finish(nxt, nxt.queued("rollout")[0])
    while nxt.queued("judge"):
        finish(nxt, nxt.queued("judge")[0])
    assert nxt.done() and nxt.book.done()
    assert [s.id for s in nxt.ordered_samples()] == [(3, 1, 0), (3, 1, 1), (4, 0, 0), (4, 0, 1), (4, 1, 0), (4, 1, 1)]
    assert nxt.samples[(3, 1, 1)].response_ids == [6] and nxt.judge_runs == 6
