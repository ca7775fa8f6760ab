"""Imported last by the gates' forkserver (spawn._context): everything the server preloaded
moves to the permanent generation (gc.freeze), so a forked rank's collections never walk the
inherited objects. Each such walk in a fresh fork touched ~300k inherited objects and wrote
their headers, copying their pages: measured on the 2-core box, 10 one-step 2-rank fleets took
9.2-10.4 s without it and 3.9-5.0 s with it, and `pytest -m gate` 182-205 s against 155-177 s."""

import gc

gc.collect()
gc.freeze()
