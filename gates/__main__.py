"""`python -m gates`: run every gate, print the records, write docs/status.md and the README's
gate lines (between its status markers, from the same records), exit 1 on a FAIL.

    python -m gates                     all gates on the CPU (gloo, 2 ranks)
    python -m gates --cuda-fleet        the fleet gates on nccl, one process per card
    python -m gates --cuda              the one-card gates on CUDA (causality with the fla arm,
                                        the kernel arms vs their references)
    python -m gates g03_unequal g05_nonfinite     a subset (the table is not written)
    python -m gates --mutations         plant every bug of gates/mutation_list/, run the gates
                                        that must catch it, write docs/mutations.md
    python -m gates --mutations NAME..  only these mutations (the table is not written)
    python -m gates --mutations --jobs 2    the pairs in 2 worker processes
    python -m gates --mutations NAME.. --merge   only these, their rows merged into the table
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BEGIN, END = "<!-- status:begin -->", "<!-- status:end -->"


def embed_in_readme(lines: list[str], readme: Path) -> None:
    """Put the gates' lines (status.gate_lines) between the README's status markers."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"README has no {BEGIN} ... {END} markers; gate lines not written", file=sys.stderr)
        return
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    body = "\n".join(lines)
    readme.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")
    print(f"gate lines written to {readme}")


def main(argv: list[str] | None = None) -> int:
    import os

    # Deterministic cuBLAS for the CUDA gates (fixtures.exact_fp32); read once, when cuBLAS
    # starts, so before anything touches a GPU.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from gates import ROOT
    from gates.status import (
        GATES,
        gate_lines,
        load,
        load_cuda_records,
        save_cuda_records,
        timed,
        write_status,
    )

    p = argparse.ArgumentParser(prog="python -m gates", description=__doc__.splitlines()[0])
    p.add_argument("only", nargs="*", help=f"gate names (default: all): {', '.join(GATES)}")
    p.add_argument(
        "--cuda-fleet",
        action="store_true",
        help="run the fleet gates on nccl with one process per CUDA device (needs >= 2)",
    )
    p.add_argument(
        "--cuda",
        action="store_true",
        help="run the gates that need one CUDA card (SINGLE_CUDA) on the GPU",
    )
    p.add_argument(
        "--mutations",
        action="store_true",
        help="run the mutation list (positional names are then mutation names)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="--mutations: run the (mutation, gate) pairs in N worker processes "
        "(each pair's fleets still spawn their ranks; 2 on a 2-core box: ~2x)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="--mutations NAME..: replace (or add) these rows in docs/mutations.md, keep the rest",
    )
    p.add_argument(
        "--out",
        default=str(ROOT / "docs" / "status.md"),
        help="where the status table goes (written only when every gate ran)",
    )
    args = p.parse_args(argv)
    if args.jobs < 1 or (args.jobs > 1 and not args.mutations):
        p.error(f"--jobs {args.jobs}: a count >= 1 of worker processes for --mutations")
    if args.mutations:
        return run_mutations(args.only, ROOT / "docs" / "mutations.md", jobs=args.jobs,
                             merge=args.merge)  # fmt: skip
    unknown = [g for g in args.only if g not in GATES]
    if unknown:
        p.error(f"unknown gate(s) {unknown}; choose from {GATES}")
    if args.cuda_fleet or args.cuda:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = 2 if args.cuda_fleet else 1
        if n < need:
            flag = "--cuda-fleet" if args.cuda_fleet else "--cuda"
            print(f"{flag} needs >= {need} CUDA device(s); this machine sees {n}", file=sys.stderr)
            return 2
    names = args.only or GATES
    if args.cuda and not args.cuda_fleet:
        names = [g for g in names if getattr(load(g), "SINGLE_CUDA", False)]
    import tempfile

    # The fleets' run folders and the shared-run cache live for this command only.
    scratch = tempfile.TemporaryDirectory(prefix="dormouse-gates-")
    os.environ["DORMOUSE_GATE_CACHE"] = scratch.name
    t0 = time.perf_counter()
    records = []
    for name in names:
        mod = load(name)
        cuda = (args.cuda_fleet and getattr(mod, "CUDA", True)) or (
            (args.cuda or args.cuda_fleet) and getattr(mod, "SINGLE_CUDA", False)
        )
        rec = timed(name, lambda: mod.run(cuda=cuda))
        rec.details["ran_on_cuda"] = bool(cuda)
        records.append(rec)
        print(rec.summary(), flush=True)
        if rec.details.get("traceback"):  # a crashed gate: where, not only what
            print("    " + rec.details["traceback"].strip().replace("\n", "\n    ")[-1500:])
    failed = [r.gate for r in records if not r.passed]
    print(
        f"\n{len(records) - len(failed)}/{len(records)} gates passed in "
        f"{time.perf_counter() - t0:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    gpu = args.cuda_fleet or args.cuda
    if gpu:  # GPU rows are kept for the CPU run's table (python -m gates merges them)
        save_cuda_records([r for r in records if r.details.get("ran_on_cuda")])
        print("GPU records saved to docs/status-cuda.json")
    elif not args.only:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        gpu_rows = load_cuda_records()
        write_status(records, out, gpu_rows)
        print(f"status table written to {out}")
        if out.resolve() == (ROOT / "docs" / "status.md").resolve():
            embed_in_readme(gate_lines(records, gpu_rows), ROOT / "README.md")
    scratch.cleanup()
    return 1 if failed else 0


def run_mutations(only: list[str], out: Path, jobs: int = 1, merge: bool = False) -> int:
    import concurrent.futures
    import multiprocessing
    import os
    import tempfile

    from gates.mutation_list import BY_NAME, MUTATIONS
    from gates.mutations import merge_rows, read_table, run_named, run_one, write_table

    unknown = [n for n in only if n not in BY_NAME]
    if unknown:
        print(f"unknown mutation(s) {unknown}; choose from {list(BY_NAME)}", file=sys.stderr)
        return 2
    scratch = tempfile.TemporaryDirectory(prefix="dormouse-mutations-")
    os.environ["DORMOUSE_GATE_CACHE"] = scratch.name
    t0 = time.perf_counter()
    pairs = [(m.name, gate) for m in [BY_NAME[n] for n in only] or MUTATIONS for gate in m.gates]

    def said(row: dict) -> None:
        print(
            f"[{row['outcome']}] {row['mutation']} -> {row['gate']} ({row['seconds']:.1f} s): "
            f"{row['measured'][:300]}",
            flush=True,
        )

    if jobs == 1:
        rows = []
        for name, gate in pairs:
            rows.append(run_one(BY_NAME[name], gate))
            said(rows[-1])
    else:  # fresh interpreters (spawn): each keeps its own planted bugs and fork server; the
        # scratch cache is shared under its file locks, as between pytest-xdist workers
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = [pool.submit(run_named, *pair) for pair in pairs]
            for f in concurrent.futures.as_completed(futures):
                said(f.result())
            rows = [f.result() for f in futures]  # the list's order, not completion's
    bad = [r for r in rows if r["outcome"] != "caught"]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} caught in {time.perf_counter() - t0:.0f} s"
          + (f"; NOT caught: {', '.join(r['mutation'] + '->' + r['gate'] for r in bad)}"
             if bad else ""))  # fmt: skip
    if not only or merge:
        write_table(merge_rows(read_table(out), rows) if only else rows, out)
        print(f"mutation table written to {out}" + (" (these rows merged)" if only else ""))
    scratch.cleanup()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
