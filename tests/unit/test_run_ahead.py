"""--max-staleness K > 0, the partial rollout as rank 0's StepQueues sees it, driven by hand: once the
train ranks have made the update, it is published at the next round's start, the next step's prompts
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
        sample = Sample(*request.key, request.prompt_ids, [6], [-0.5], "stop", versions=[(0, queues.version)])
        judging = Request("judge", request.key, [7], 8, 0.0, step=request.step)
        queues.ingest([Report("rollout", responses=[(sample, judging)])], 0.0)
    else:
        verdict = Verdict(request.key, "", 1, 1, reward, False, True, 0, step=request.step)
        queues.ingest([Report("judge", verdicts=[verdict])], 0.0)


def test_the_update_made_the_next_step_begins_and_what_is_left_of_it_carries_over():
    queues = StepQueues(PROMPTS, step=3, sampling=SAMPLING, algo=Algorithm(), early_train=True, train_pool=POOL, version=1, ahead=AHEAD)
    assert not queues.publish_due()  # nothing made yet
    queues.ingest([Report("train", trained={**NO_EARLY, "groups": [0, 1]}, train_s=0.1)], 0.0)
    assert queues.update_due() and not queues.publish_due()
    queues.ingest([Report("train", update={"loss": 0.0})], 0.0)
    assert queues.publish_due()
    assert queues.publish() == 2 and not queues.publish_due()  # once
    assert [(r.step, r.key) for r in queues.queued("rollout")] == \
        [(3, (0, 0)), (3, (0, 1)), (3, (1, 0)), (3, (1, 1)), (4, (0, 0)), (4, (0, 1)), (4, (1, 0)), (4, (1, 1))]
    # the next step's first sample and its verdict go to its own queues, not this step's
    first = queues.queued("rollout")[4]
    finish(queues, first)
    judging = next(r for r in queues.queued("judge") if r.step == 4)
    finish(queues, judging, reward=0.0)
    assert (0, 0) in queues.ahead.samples and (0, 0) not in queues.samples and queues.ahead.book.judged == 1
    for request in [r for r in queues.queued("rollout") if r.step == 3]:
        finish(queues, request)
    while queues.queued("judge"):
        finish(queues, queues.queued("judge")[0])
    assert queues.done() and queues.ahead.book.judged == 1 and set(queues.ahead.samples) == {(0, 0)}
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
    assert nxt.book is carried.book and nxt.samples == {(0, 0): carried.samples[(0, 0)]}
    assert nxt.book.judged == 1 and nxt.book.phase[0] == 4 and nxt.judge_runs == 1 and not nxt.done()


def test_without_a_step_to_run_ahead_into_the_update_waits_for_the_step_end():
    """A step whose update ends in a checkpoint (no `ahead`) publishes nothing during the rollout."""
    queues = StepQueues(PROMPTS, step=3, sampling=SAMPLING, algo=Algorithm(), early_train=True, train_pool=POOL, version=1)
    queues.ingest([Report("train", trained={**NO_EARLY, "groups": [0, 1]}, train_s=0.1)], 0.0)
    queues.ingest([Report("train", update={"loss": 0.0})], 0.0)
    assert queues.update is not None and not queues.publish_due()
    assert queues.carry([]) is None
