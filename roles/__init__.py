"""The three roles a rank can hold, named once for the whole project, and the project's vocabulary: one
name for each concept in the code, its flags, its records and the docs (tests/unit/test_vocabulary.py
holds the code to some of it).

- role: what a rank does now: rollout (the policy's vLLM engine), judge (the judge's) or train (FSDP2).
- rank: one process of the run (torchrun's), on a device of its own; slot: the ranks one engine spans
  (--engine-tp consecutive ranks of one node; in sim/, the devices one instance of the widest role needs),
  holding one role at a time: what the planner moves, the scheduler orders and --split counts
  (shifting/book.py slot_shape); at --engine-tp 1 a slot is a rank.
- step: one RL step, one update: `--prompts-per-step` prompts x `--group-size` responses rolled out,
  judged and trained on; `--steps` counts them.
- engine step: one step of a vLLM engine (`Engine.step`): each running sequence decodes a token, new
  requests prefill (whole prompts on CPU, in chunks on GPU); an RL step takes many.
- optimizer step: one AdamW step; an update takes `--minibatches` of them (`PolicyTrainer.optimizer_steps`).
- round: ranks work on their own (engine steps or training), then all report to rank 0 and get their
  orders: role, new requests, the next round's length (shifting/scheduler.py).
- move: the planner's order that one rank change role (`planner.Move`); plan: the planner's moves for a
  round (`planner.plan`) and nothing else (each round's roles, in any placement: `Placement.next_roles`).
- shift: a rank carrying out its move: drain, offload, onload, ready (shifting/context.py).
- migration: a shifting rank's in-flight sequences resume elsewhere with their sampler's state, token for token.
- placement: where each role runs (`--placement`); pivot's planner (planner.py) picks each round's moves.
- request: one sequence for an engine: a rollout request per sample, a judge request per response.
- batch: the sequences one engine step runs (a step's prompt records are its `prompts`); micro-batch:
  the samples of one forward pass (`--micro-batch`); minibatch: those of one optimizer step.
- group: the G responses to one prompt; the train group: the ranks holding train, one FSDP2 group.
- sample: one response with its prompt, versions, critique, reward and advantage (`Sample`).
- critique: the judge's text on one response; verdict: its last line, read into the reward (`Verdict`).
- update: a step's optimizer steps over its groups; publish: the update written to storage as a version.
- version: the weights after v updates (`Sample.version`: the one that sampled its first token);
  staleness: how many versions older than the update's weights its samples are, at most K.
- storage: the Global Parameter Storage (storage.py): per node one shared-memory copy of each model's
  published weights and of the policy's training state, from which every role loads; region: where one
  tensor lies in it; shard: the rows of dim 0 a train rank holds under FSDP2 (export.py's shards are
  Hugging Face's: the safetensors files of one model).
- store: the launch's TCPStore (`Dist.store`), for signals that must not wait for a collective.
- checkpoint: OUT/checkpoints/step-N (checkpoint.py), what a restarted run resumes from.
- span: a stretch of time one rank held one role, shifted, waited at a round's exchange (WAIT) or spent
  in a phase (timeline.jsonl).
- phase: a part of a run outside its steps' roles (PHASES): the start-up (imports, data, engines, storage,
  the first roles), an evaluation, a checkpoint, the final export.
"""
import enum


class Role(str, enum.Enum):
    """A rank's role. A str enum: a member equals, hashes and JSON-encodes as its value, so role names read
    from flags, records and calibration files compare with and look up the members directly."""
    ROLLOUT = "rollout"
    JUDGE = "judge"
    TRAIN = "train"

    def __str__(self) -> str:
        """The value, as f-strings and str() write it into messages, metric names and file names (a mixed-in
        enum would write `Role.ROLLOUT`)."""
        return self.value

    def __repr__(self) -> str:
        """The value's repr, so that printed lists and dicts of roles (a split, a plan's roles) read as the
        role names they always were."""
        return repr(self.value)


ENGINE_ROLES = (Role.ROLLOUT, Role.JUDGE)  # roles that run a vLLM engine
ROLES = ENGINE_ROLES + (Role.TRAIN,)
# A timeline span's "role" beside the roles and "shift": a rank blocked at a round's exchange until every
# rank has reported and rank 0 has decided, and the phases, in the order a run meets them.
WAIT = "wait"
PHASES = ("startup", "eval", "checkpoint", "export")
