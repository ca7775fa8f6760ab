"""`python -m gates`: run every gate, print the records, write docs/status.md, exit 1 on a FAIL.

    python -m gates                     all gates on the CPU (gloo, 2 ranks)
    python -m gates --cuda-fleet        the fleet gates on nccl, one process per card
    python -m gates g03_unequal g05_nonfinite     a subset (the table is not written)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


BEGIN, END = "<!-- status:begin -->", "<!-- status:end -->"


def embed_in_readme(status: Path, readme: Path) -> None:
    """Put the generated table between the README's status markers (never typed by hand)."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"README has no {BEGIN} ... {END} markers; table not embedded", file=sys.stderr)
        return
    body = status.read_text().split("\n", 1)[1].strip()  # drop the file's own title
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")
    print(f"status table embedded in {readme}")


def main(argv: list[str] | None = None) -> int:
    from gates.harness import GATES, ROOT, load, timed, write_status

    p = argparse.ArgumentParser(prog="python -m gates", description=__doc__.splitlines()[0])
    p.add_argument("only", nargs="*", help=f"gate names (default: all): {', '.join(GATES)}")
    p.add_argument("--cuda-fleet", action="store_true",
                   help="run the fleet gates on nccl with one process per CUDA device (needs >= 2)")
    p.add_argument("--out", default=str(ROOT / "docs" / "status.md"),
                   help="where the status table goes (written only when every gate ran)")
    args = p.parse_args(argv)
    unknown = [g for g in args.only if g not in GATES]
    if unknown:
        p.error(f"unknown gate(s) {unknown}; choose from {GATES}")
    if args.cuda_fleet:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < 2:
            print(f"--cuda-fleet needs >= 2 CUDA devices; this machine sees {n}", file=sys.stderr)
            return 2
    names = args.only or GATES
    import os
    import tempfile

    # The fleets' run folders and the shared-run cache live for this command only.
    scratch = tempfile.TemporaryDirectory(prefix="dormouse-gates-")
    os.environ["DORMOUSE_GATE_CACHE"] = scratch.name
    t0 = time.perf_counter()
    records = []
    for name in names:
        mod = load(name)
        cuda = args.cuda_fleet and getattr(mod, "CUDA", True)
        rec = timed(name, lambda: mod.run(cuda=cuda))
        records.append(rec)
        print(rec.summary(), flush=True)
    failed = [r.gate for r in records if not r.passed]
    print(f"\n{len(records) - len(failed)}/{len(records)} gates passed in "
          f"{time.perf_counter() - t0:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if not args.only:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_status(records, out)
        print(f"status table written to {out}")
        if out.resolve() == (ROOT / "docs" / "status.md").resolve():
            embed_in_readme(out, ROOT / "README.md")
    scratch.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
