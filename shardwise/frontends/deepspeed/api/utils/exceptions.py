"""`deepspeed.utils.exceptions`: the exception DeepSpeed raises for APIs it has retired."""


class DeprecatedException(Exception):
    """A DeepSpeed API that no longer exists was called (`groups.initialize`)."""
