"""The three roles a rank can hold, named once for the whole project."""
ENGINE_ROLES = ("rollout", "judge")  # roles that run a vLLM engine
ROLES = ENGINE_ROLES + ("train",)
