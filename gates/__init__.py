"""The gates: one module per claim (gNN_*.py), each a fleet run held against a hand-written
reference. `python -m gates` runs them all and writes docs/status.md."""

from pathlib import Path

#: The repository (gates/ and references/ import from it; launched processes get it on the path).
ROOT = Path(__file__).resolve().parent.parent
