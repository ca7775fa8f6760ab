"""dormouse: a trainer for small byte-level language models on the GPUs people own."""

import os as _os

# OpenMP threads that spin while they wait turn a busy CPU into a crawl: on the 2-core
# box a `small` step measured 2.8 s with passive waiting and ~20 s with the default
# spinning once another process shared the cores (torch 2.13). Set before torch loads;
# an explicit setting in the environment wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
