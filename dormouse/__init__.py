"""dormouse: a trainer for small byte-level language models on the GPUs people own."""

import os as _os
import time as _time

#: when this process imported dormouse: a run's log says how long it took to reach step 1
STARTED = _time.perf_counter()

# OpenMP threads that spin while they wait turn a busy CPU into a crawl: on the 2-core
# box a `small` step measured 2.8 s with passive waiting and ~20 s with the default
# spinning once another process shared the cores (torch 2.13). Set before torch loads;
# an explicit setting in the environment wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Triton's kernels and autotune results under dormouse's cache folder, before anything can
# import Triton: fla's kernels tune for ~3 minutes per shape on a fresh machine (measured on
# an H200, issue #16), and Triton keeps the winners only when asked to (dormouse/cache.py).
from .cache import place_kernel_caches as _place  # noqa: E402

_place()

__version__ = "0.1.0"
