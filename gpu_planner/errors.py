"""Exceptions raised by the planner before any byte moves."""


class PlanValidationError(ValueError):
    """Bad planner input: names the argument, buffer or page at fault."""


class BoundsError(PlanValidationError):
    """A descriptor would reach past the end of its registered buffer.

    This is what a wrong destination index space (host page ids used for a
    device-backed buffer, the HiSparse bug class) looks like when buffer
    lengths are known.
    """
