"""Which exceptions are the user's to fix: `UserError`, printed by the CLI as one line, exit 2.

A UserError is raised on purpose, with the cause, the measured fact and the escape in its
message; anything else that escapes the CLI is a bug and keeps its traceback. Each module
keeps its own family (ConfigError, DataError, CheckpointError, ...) as a subclass.
"""

from __future__ import annotations


class UserError(Exception):
    """A refusal whose message names the cause, the measured fact and the escape."""


#: Families not yet subclassing UserError, matched by name until their modules do
#: (`class DtypeError(UserError, ValueError)` and so on: a one-line change in each of
#: train/device.py, train/fit.py and train/distributed.py). Remove once empty.
_NOT_YET_SUBCLASSES = {"DtypeError", "DeviceError", "FitError", "LaunchError", "DistError",
                       "RefusedError"}  # fmt: skip


def is_user_error(e: BaseException) -> bool:
    """True for a UserError (and, for now, the families listed above)."""
    if isinstance(e, UserError):
        return True
    return any(cls.__name__ in _NOT_YET_SUBCLASSES for cls in type(e).__mro__)
