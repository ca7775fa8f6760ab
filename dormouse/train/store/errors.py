"""The store's error class, in a module of its own: checkpoint.py and tensorfile.py both raise
it, and checkpoint.py reads through tensorfile.py."""

from __future__ import annotations

from ...errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint or run folder the run cannot use or write; names cause and escape."""
