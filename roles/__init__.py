"""The three roles a rank can hold, named once for the whole project."""
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
