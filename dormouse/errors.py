"""Which exceptions are the user's to fix (printed as one clean line by the CLI)."""

from __future__ import annotations


def is_user_error(e: BaseException) -> bool:
    """Errors raised on purpose with cause and escape in the message, not bugs."""
    names = {"DataError", "CheckpointError", "TrainingError", "DtypeError", "FitError",
             "LaunchError", "DistError", "RefusedError", "ConfigError"}  # fmt: skip
    return any(cls.__name__ in names for cls in type(e).__mro__)
