"""Errors raised instead of training on to a wrong result."""


class DivergentExecutionError(RuntimeError):
    """Ranks ran different work (modules, batches) in a step where they must agree."""


class NonFiniteGradientError(RuntimeError):
    """Too many consecutive optimizer steps had non-finite gradients."""
