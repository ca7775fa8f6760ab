"""Which exceptions are the user's to fix: `UserError`, printed by the CLI as one line, exit 2.

A UserError is raised on purpose, with the cause, the measured fact and the escape in its
message; anything else that escapes the CLI is a bug and keeps its traceback. Each module
keeps its own family as a subclass: ConfigError, DataError, CheckpointError, TrainingError,
SampleError, DtypeError, DeviceError, FitError, DistError (LaunchError, RefusedError).
"""

from __future__ import annotations


class UserError(Exception):
    """A refusal whose message names the cause, the measured fact and the escape."""


class ConfigError(UserError, ValueError):
    """A configuration the system cannot honour; the message names cause and escape."""
