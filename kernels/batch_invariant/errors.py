"""The one error every batch-invariant op raises for an argument it cannot take.

Its own module so that the Triton launchers, which ops.py imports only when a kernel runs, raise the same
class without importing ops.py back.
"""


class BatchInvariantInputError(ValueError):
    """An argument a batch-invariant op cannot take; the message names it and why."""
