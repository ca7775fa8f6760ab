"""The ring all-reduce arithmetic over PCIe: what a data-parallel step pays to agree.

Owns the PCIe rate table, the ring's bytes per rank, the seconds those bytes take at an
assumed efficiency, the bucket size derived from the payload, and
`python -m dormouse link` (`main_link`), which prints the arithmetic with every input named.
Everything here is COMPUTED from a formula; a two-card run replaces it with a reading.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

MiB = 1 << 20

#: PCIe per-lane signalling rate (GT/s, one bit per transfer per lane) and line-code
#: efficiency, per the PCI-SIG base specifications: 8b/10b for gen1-2, 128b/130b for gen3-5,
#: and for gen6 (PAM4, FLIT mode) the 242 payload bytes of each 256-byte FLIT. Per-lane
#: GB/s = GT/s x efficiency / 8: 0.25, 0.5, 0.985, 1.969, 3.938, 7.563.
PCIE = {
    1: (2.5, 8 / 10),
    2: (5.0, 8 / 10),
    3: (8.0, 128 / 130),
    4: (16.0, 128 / 130),
    5: (32.0, 128 / 130),
    6: (64.0, 242 / 256),
}

#: Fraction of the theoretical link an all-reduce achieves. An ASSUMPTION, not a
#: measurement: TLP headers, flow control and NCCL's protocol overheads take the rest;
#: the two-card run is what replaces this number.
LINK_EFFICIENCY = 0.8

#: Bytes per gradient element on the wire for each reduce dtype (TrainConfig.dist_reduce).
REDUCE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

#: Used when this machine's link cannot be read; printed as an assumption whenever used.
ASSUMED_LINK = (4, 16)

# bucket_mb_for's clamp. The /8 and both bounds are a GUESS: no bucket sweep has been run
# on two cards yet (a known gap); the clamp keeps tiny models from paying one launch per
# few KiB and huge ones from serialising behind a single bucket.
BUCKET_DIVISOR = 8
BUCKET_MIN_MB = 4.0
BUCKET_MAX_MB = 128.0


class LinkError(ValueError):
    """Arithmetic inputs that do not describe a link or a fleet."""


def lane_rate(gen: int) -> float:
    """Theoretical bytes/s of one lane of PCIe generation `gen`, after line coding."""
    if gen not in PCIE:
        raise LinkError(f"PCIe gen{gen} is not in the table (gen1..gen{max(PCIE)}); pass --gen N")
    gts, eff = PCIE[gen]
    return gts * 1e9 * eff / 8


def link_rate(gen: int, width: int) -> float:
    """Theoretical bytes/s of a gen/width link, one direction."""
    if width < 1:
        raise LinkError(f"PCIe width x{width} must be at least x1")
    return lane_rate(gen) * width


def allreduce_bytes_per_rank(payload: float, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce: a reduce-scatter then an all-gather, each
    moving (P-1)/P of the payload. Exactly one payload at P=2."""
    if world < 1:
        raise LinkError(f"world={world}: a fleet has at least one rank")
    return 2 * (world - 1) / world * payload


def allreduce_seconds(
    params: int,
    reduce_bytes: int,
    world: int,
    gen: int,
    width: int,
    efficiency: float = LINK_EFFICIENCY,
) -> float:
    """Seconds one all-reduce of `params` gradients takes over a gen/width link."""
    payload = params * reduce_bytes
    return allreduce_bytes_per_rank(payload, world) / (link_rate(gen, width) * efficiency)


def bucket_mb_for(payload_bytes: float) -> float:
    """DDP bucket size in MiB: the payload / 8, clamped to 4..128 MiB (a guess; see above)."""
    mb = payload_bytes / BUCKET_DIVISOR / MiB
    return min(BUCKET_MAX_MB, max(BUCKET_MIN_MB, mb))


# ---- the command ----------------------------------------------------------------------


def _count_params(preset_name: str) -> tuple[int, str]:
    """(params, where the number came from). Falls back to the design's nominal size when
    the model cannot be counted, and says so."""
    from ...config import PRESET_PARAMS, preset

    cfg = preset(preset_name)  # ConfigError names the presets
    try:
        from ... import model as model_pkg

        count = getattr(model_pkg, "count_params", None)
        if count is None:
            from ...model.model import count_params as count
        return int(count(cfg.model)), f"preset {preset_name}, counted by count_params (meta device)"
    except Exception as e:
        why = f"{type(e).__name__}: {e}".splitlines()[0]
        if preset_name in PRESET_PARAMS:
            n = int(PRESET_PARAMS[preset_name])
            return n, (
                f"preset {preset_name}: NOMINAL size from the design, not a count; "
                f"count_params unavailable: {why}; pass --params N for a count"
            )
        raise LinkError(
            f"cannot count preset {preset_name!r}'s parameters (count_params unavailable: {why}) "
            f"and it has no nominal size; pass --params N"
        ) from None


def _read_link(probe: Callable | None = None) -> tuple[int | None, int | None, str]:
    """This machine's slowest visible link (the ring waits for it), or why it is unread."""
    try:
        if probe is None:
            from ..plan.device import probe
        records = [r for r in probe(memory=False) if r.kind == "cuda"]
    except Exception as e:
        return None, None, f"the probe failed ({type(e).__name__}: {e})".splitlines()[0]
    if not records:
        return None, None, "no CUDA device visible"
    read = [r for r in records if r.pcie_gen_max and r.pcie_width_max]
    if not read:
        return None, None, records[0].note or "NVML gave no link"
    slow = min(read, key=lambda r: link_rate(r.pcie_gen_max, r.pcie_width_max))
    where = f"read: max gen/width of {slow.label} {slow.name} via NVML"
    if len(read) > 1:
        where += f", the slowest of {len(read)} cards"
    return slow.pcie_gen_max, slow.pcie_width_max, where


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def main_link(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    """`python -m dormouse link`: the ring all-reduce arithmetic, every input named."""
    ap = argparse.ArgumentParser(prog="dormouse link", description=main_link.__doc__)
    ap.add_argument("--preset", help="count this preset's parameters")
    ap.add_argument("--params", type=int, help="parameter count (overrides --preset)")
    ap.add_argument(
        "--world", type=int, default=2, help="ranks (default 2); 2 and 4 are always shown"
    )
    ap.add_argument(
        "--reduce",
        choices=sorted(REDUCE_BYTES),
        default="bf16",
        help="gradient dtype on the wire (as dist_reduce; default bf16)",
    )
    ap.add_argument("--gen", type=int, help="PCIe generation (default: read, else gen4)")
    ap.add_argument("--width", type=int, help="PCIe lanes (default: read, else x16)")
    argv = list(argv or [])
    if argv[:1] == ["--"]:  # `dormouse link -- --preset P`: the CLI's remainder separator
        argv = argv[1:]
    args = ap.parse_args(argv)
    try:
        return _run_link(args, out)
    except LinkError as e:
        out(f"link: {e}")
        return 2
    except ValueError as e:  # ConfigError for an unknown preset
        out(f"link: {e}")
        return 2


def _run_link(args, out) -> int:
    if args.params is not None:
        if args.params < 1:
            raise LinkError(f"--params {args.params}: a model has at least one parameter")
        params, p_src = args.params, "--params"
        if args.preset:
            p_src += f" (overrides --preset {args.preset})"
    elif args.preset:
        params, p_src = _count_params(args.preset)
    else:
        raise LinkError("nothing to reduce: pass --preset P (tiny|small|medium|b1) or --params N")
    if args.world < 1:
        raise LinkError(f"--world {args.world}: a fleet has at least one rank")

    gen, width = args.gen, args.width
    if gen is not None and width is not None:
        l_src = "given (--gen/--width)"
    else:
        r_gen, r_width, why = _read_link()
        if r_gen is not None:
            l_src = why
        else:
            r_gen, r_width = ASSUMED_LINK
            l_src = f"ASSUMED gen{r_gen} x{r_width}: this machine's link could not be read: {why}"
        if gen is not None or width is not None:
            l_src = f"--{'gen' if gen is not None else 'width'} given; the rest " + l_src
        gen = r_gen if gen is None else gen
        width = r_width if width is None else width

    rb = REDUCE_BYTES[args.reduce]
    payload = params * rb
    theo = link_rate(gen, width)
    eff = theo * LINK_EFFICIENCY
    out("ring all-reduce arithmetic (COMPUTED from the inputs below, not measured)")
    out(f"  params      {params:,}  ({p_src})")
    out(f"  reduce      {args.reduce} = {rb} B per gradient (--reduce; fp32 is the exact one)")
    out(f"  payload     {_mb(payload)} = params x {rb} B")
    out(f"  link        PCIe gen{gen} x{width} = {theo / 1e9:.2f} GB/s theoretical ({l_src})")
    out(
        f"  efficiency  {LINK_EFFICIENCY:.2f} -> {eff / 1e9:.2f} GB/s "
        f"(LINK_EFFICIENCY: an assumption, not a measurement)"
    )
    out(
        f"  bucket      {bucket_mb_for(payload):.1f} MiB (bucket_mb_for: payload/{BUCKET_DIVISOR} "
        f"clamped to {BUCKET_MIN_MB:g}..{BUCKET_MAX_MB:g} MiB; "
        f"a guess until two cards sweep it)"
    )
    out("  formula     bytes/rank = 2(P-1)/P x payload; seconds = bytes/rank / (link x efficiency)")
    out("")
    out(f"  {'ranks':>5}  {'payloads/rank':>13}  {'bytes/rank':>11}  {'ms/all-reduce':>13}")
    for world in sorted({2, 4, args.world}):
        per = allreduce_bytes_per_rank(payload, world)
        ms = allreduce_seconds(params, rb, world, gen, width) * 1e3
        out(f"  {world:>5}  {per / payload:>13.2f}  {_mb(per):>11}  {ms:>13.1f}")
    return 0
