"""The reference a fleet is held against: one process at the fleet's global batch.

`single(spec)` runs `references/single.py` on the fixture of `spec` with the same recorder on
the same callbacks, cached by its effective config, so gates whose references are the same run
share one; `cli_reference` does the same for a CLI fleet's --set values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

from gates.cache import cached, work_dir
from gates.fixtures import FleetSpec, batches_of, exact_fp32, fixture_run, threads
from gates.recorder import Recorder, no_plot, record_inputs

#: Fields a one-process run never reads (the fleet's reduce, sharding, buckets and timeout):
#: two gates whose references differ only there share one reference run.
_FLEET_ONLY = {"dist_shard": "none", "dist_reduce": "auto", "bucket_mb": 0.0,
               "dist_timeout": 600.0}  # fmt: skip


def _reference_key(spec: FleetSpec, batches: list[int], steps: int | None) -> str:
    """What a reference's result depends on: its effective config (the fixture at the global
    batch sum(batches), without its folder and the fields in _FLEET_ONLY), so that the gates
    whose references are the same run share one (the fleet specs differ by name and split)."""
    from references.single import global_run

    run = global_run(fixture_run(spec, Path("reference"), dist=False), batches)
    t = dataclasses.replace(run.train, out_dir="", **_FLEET_ONLY,
                            **({"steps": steps} if steps is not None else {}))  # fmt: skip
    return repr(dataclasses.replace(run, train=t).to_json())


def single(spec: FleetSpec, batches: list[int] | None = None, *, probe=None,
           resume_from: str | None = None, steps: int | None = None,
           drop_steps: tuple[int, ...] = (), split_rows: bool = False,
           fresh: bool = False) -> dict:  # fmt: skip
    """The reference: one process at the global batch of `spec` (cached like a fleet, by its
    effective config: `_reference_key`, so gates whose references are the same run share it).

    `drop_steps`: 0-based steps whose batch the reference never trains on (no forward, no
    backward): what a fleet's skipped step must be equivalent to. `split_rows`: the same run
    with each batch run as the fleet's per-rank pieces in one process, for the reference's
    own round-off spread. `fresh`: run it now and keep it out of every cache, for a run under
    a patch of this process (a test's monkeypatch): no reference, and the config key cannot
    see the patch, so a cached run would answer for it, or it for a later reference.
    """
    spec = dataclasses.replace(spec, mutation="")  # the reference never runs a planted bug
    batches = batches or batches_of(spec)
    tag = repr((_reference_key(spec, batches, steps), tuple(batches) if split_rows else (),
                probe.__name__ if probe else None, resume_from, drop_steps))  # fmt: skip

    def compute():
        import shutil

        from references.single import build_model, global_run, run_single

        out = work_dir(f"single-{spec.name}")
        run = global_run(fixture_run(spec, out, dist=False), batches)
        if steps is not None:
            run = dataclasses.replace(run, train=dataclasses.replace(run.train, steps=steps))
        recorder = Recorder(probe=probe)
        if resume_from:
            shutil.copy(resume_from, Path(run.train.out_dir) / f"{run.train.ckpt_name}.pt")
        if spec.cuda:
            exact_fp32()
        t0 = time.perf_counter()
        with threads(1), no_plot():
            model = build_model(run)
            inputs: list = []
            record_inputs(model, inputs)
            _, report = run_single(run, callbacks=recorder.callbacks(), model=model,
                                   resume=bool(resume_from),
                                   drop_steps=drop_steps,
                                   split_rows=tuple(batches) if split_rows else ())  # fmt: skip
            rec = recorder.finish()
        return {"rec": rec, "report": report, "elapsed": time.perf_counter() - t0,
                "run": run.to_json(), "out": str(out), "inputs": inputs}  # fmt: skip

    if fresh:
        return compute()
    return cached("single-" + hashlib.sha256(tag.encode()).hexdigest()[:16], compute)


def cli_reference(sets: tuple[str, ...], batches: list[int], steps: int) -> dict:
    """One process at the global batch of a CLI fleet run of `tiny` with these --set
    values (cached): the recorder's record, losses per step."""
    from dormouse.config import apply_sets, preset, validate

    tag = "cli-ref-" + hashlib.sha256(repr((sets, batches, steps)).encode()).hexdigest()[:16]

    def compute():
        from references.single import global_run, run_single

        out = work_dir("cli-ref")
        fleet_run = validate(apply_sets(preset("tiny"), [*sets, f"out_dir={out}",
                                                         f"steps={steps}"]))  # fmt: skip
        run = global_run(fleet_run, batches)
        if run.train.device == "cuda":
            exact_fp32()
        recorder = Recorder()
        with threads(1), no_plot():
            run_single(run, callbacks=recorder.callbacks())
        return recorder.finish()

    return cached(tag, compute)
