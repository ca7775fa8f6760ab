"""`python -m dormouse {train,eval,sample,export,compare,plan,probe,link,bench}`: the command line.

Each subcommand parses its flags and hands off to the module that owns the work;
no training logic lives here.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
from dataclasses import replace

from .config import (
    ConfigError,
    apply_sets,
    check_device,
    check_path,
    preset,
    preset_names,
    validate,
)
from .errors import UserError

log = logging.getLogger("dormouse")


class _RankFilter(logging.Filter):
    """On a fleet, INFO lines come from rank 0 only (it speaks for the fleet); warnings, errors
    and lines logged with extra={"every_rank": True} come from every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = os.environ.get("RANK", "0") or "0"
        return (
            rank == "0" or record.levelno >= logging.WARNING or getattr(record, "every_rank", False)
        )


class _LineHandler(logging.Handler):
    """One write per line: a fleet's ranks share one pipe, and print() writes the text and
    the newline separately when stdout is unbuffered, so two ranks' lines could interleave
    mid-line. A single write under PIPE_BUF bytes stays whole."""

    def __init__(self, stream_name: str):
        super().__init__(logging.INFO)
        self.stream_name = stream_name  # looked up per line: tests swap sys.stdout
        self.addFilter(_RankFilter())

    def emit(self, record: logging.LogRecord) -> None:
        stream = getattr(sys, self.stream_name)
        stream.write(self.format(record) + "\n")
        stream.flush()


def setup_logging(stream_name: str = "stdout") -> logging.Handler:
    """The `dormouse` logger's one handler (replacing an earlier one): every module logs
    through `logging.getLogger(__name__)`; `sample` sends it to stderr, its text to stdout."""
    for h in [h for h in log.handlers if isinstance(h, _LineHandler)]:
        log.removeHandler(h)
    handler = _LineHandler(stream_name)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


def _with_data(run, paths: list[str]):
    """--data's paths as typed: through `--set data=` a comma would split a path in two and
    its spaces would be dropped; an empty one (an unset shell variable) is refused, not read
    as "no --data" (the embedded default corpus)."""
    if not all(paths):
        raise ConfigError(f"--data {' '.join(repr(p) for p in paths)}: an empty path (an unset "
                          f"shell variable?); name the file, or omit --data for the embedded "
                          f"default corpus")  # fmt: skip
    return replace(run, train=replace(run.train, data=tuple(paths)))


def _run_from_args(args):
    run = preset(args.preset)
    sets = list(args.set or [])
    if args.steps is not None:
        sets.append(f"steps={args.steps}")
    # `is not None`: an empty --out or --device (an unset shell variable) must reach validate,
    # not fall back to runs/PRESET or auto
    if args.out is not None:
        sets.append(f"out_dir={args.out}")
    if args.device is not None:
        sets.append(f"device={args.device}")
    if getattr(args, "dist", False):
        sets.append("dist=true")
    if getattr(args, "capacity", None):
        sets.append(f"dist_capacity={args.capacity}")
    if getattr(args, "fit", None) is not None:
        if not args.fit > 0:  # fit_gb=0 is "no --fit": --fit 0 would train unfitted, silently
            raise ConfigError(f"--fit {args.fit:g}: '{args.fit:g}' is not a card size; give the "
                              f"card's memory in GB (e.g. --fit 16), or omit --fit")  # fmt: skip
        sets.append(f"fit_gb={args.fit}")
    run = apply_sets(run, sets)
    if getattr(args, "data", None):
        run = _with_data(run, args.data)
    if not args.out and run.train.out_dir == "runs/default":
        run = apply_sets(run, [f"out_dir=runs/{args.preset}"])
    return run


def _elastic_restart(env) -> int:
    """torchrun's restart counter: > 0 when this process replaces a failed attempt."""
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


_PLAN_WORDS = {"fresh": "start afresh", "resume": "resume", "complete": "do nothing (complete)"}


def cmd_train(args) -> int:
    from .train.run import dry_run, prepare_for_launch, train_run
    from .train.store.folder import RunDir

    asked = _run_from_args(args)
    if asked.train.dist or os.environ.get("WORLD_SIZE", "").strip() not in ("", "1"):
        from .train.fleet.launch import check_launch

        check_launch(asked.train.dist, os.environ)
    fleet_dry = args.dry_run and asked.train.dist  # the fleet's checks run when its ranks meet
    # validated and resolved once (device, --fit, dropout=auto, compile=auto); the folder is
    # planned with the run as asked, whose auto fields match any resolution of them
    prepared = None if fleet_dry else prepare_for_launch(asked)
    run = asked if fleet_dry else prepared[0]
    folder = RunDir(run.train.out_dir)
    # one writer a folder: this process, or rank 0 of a fleet (the others write nothing)
    writer = os.environ.get("RANK", "0") in ("", "0")
    with folder.hold(run, overwrite=args.overwrite, writer=writer, dry=args.dry_run):
        plan = folder.plan(asked, args.resume or "never", args.overwrite,
                           _elastic_restart(os.environ))  # fmt: skip
        if fleet_dry:
            log.info(f"dry run: fleet launch accepted; would {_PLAN_WORDS[plan]} in "
                     f"{run.train.out_dir} (the fleet's own checks run when its ranks meet); "
                     f"nothing trained or written")  # fmt: skip
            return 0
        if args.dry_run:
            said = dry_run(*prepared, plan, folder)
            log.info(f"dry run: ok ({said}; would {_PLAN_WORDS[plan]} in {run.train.out_dir}); "
                     f"nothing trained or written")  # fmt: skip
            return 0
        if plan == "complete":
            return 0
        if writer:
            _say_cleaned(folder.clean_stale_temps(), run.train.out_dir)
            aside = folder.set_metrics_aside() if plan == "fresh" and not args.overwrite else None
            if aside:
                log.info(
                    f"{run.train.out_dir}: the rows of the earlier run there (it wrote no "
                    f"checkpoint) are kept in {aside}; this run starts a new metrics.jsonl"
                )
        report = train_run(run, resume=plan == "resume", progress=not run.train.dist,
                           folder=folder, prepared=prepared)  # fmt: skip
    if report.get("rank", 0) == 0:
        val = report.get("val") or {}
        start = report.get("val_start") or {}
        if val:
            before = f"{start['bpb']:.4f} -> " if start else ""
            log.info(f"done: steps={report['steps']} val_bpb={before}{val['bpb']:.4f} "
                     f"checkpoint={report['checkpoint']}")  # fmt: skip
    return 0


def _say_cleaned(removed: list[str], out: str) -> None:
    if removed:
        log.info(
            f"{out}: removed {len(removed)} temp file(s) or shard folder(s) left by a "
            f"checkpoint write that never finished (a killed run): {', '.join(removed)}"
        )


def _arms_for_this_machine(run, source: str):
    """A checkpoint records the kernel arms it was trained with (say kda_impl=fla on a GPU);
    every arm computes the same function (tests/test_kda.py, tests/test_moe.py), so eval and
    sample choose afresh for the device they run on instead of refusing a CPU."""
    pinned = {k: getattr(run.model, k) for k in ("kda_impl", "moe_impl")}
    pinned = {k: v for k, v in pinned.items() if v != "auto"}
    if not pinned:
        return run
    said = " ".join(f"{k}={v}" for k, v in pinned.items())
    log.info(
        f"{source}: trained with {said}; the arms compute the same function, so this run "
        f"picks them for its own device ({' '.join(f'{k}=auto' for k in pinned)})"
    )
    return replace(run, model=replace(run.model, **dict.fromkeys(pinned, "auto")))


def cmd_eval(args) -> int:
    if args.batches is not None and args.batches < 1:
        raise ConfigError(f"--batches {args.batches}: evaluate at least one batch (omit it for "
                          f"the run's eval_batches)")  # fmt: skip
    if args.device is not None:
        check_device(args.device)
    res = score_checkpoint(args.checkpoint, args.data, args.batches, args.device)
    if not math.isfinite(res["loss"]):
        raise UserError(
            f"{args.checkpoint}: its loss on the val split is {res['loss']} (largest weight "
            f"{res['largest'][0]:.3g}, in {res['largest'][1]}): finite weights whose output "
            f"overflows, so the file was altered or its run diverged; evaluate another "
            f"checkpoint (best.pt, an earlier one)"
        )
    log.info(f"eval checkpoint={args.checkpoint} step={res['step']} loss={res['loss']:.4f} "
             f"bpb={res['bpb']:.4f} tokens={res['tokens']}")  # fmt: skip
    return 0


def score_checkpoint(path, data: list[str] | None = None, batches: int | None = None,
                     device: str | None = None) -> dict:  # fmt: skip
    """What `dormouse eval` scores: the checkpoint at `path` on its run's validation split
    (`data`: the tail of other files), every val byte once (the default) or `batches` spread
    batches; {loss, bpb, tokens, step}. Gate g33 holds the whole-split score to the
    reference's."""
    from .model import make_model
    from .model.sample import largest_weight
    from .train.data import open_data
    from .train.run import resolve_autocast, resolve_device
    from .train.step import evaluate
    from .train.store.checkpoint import load_model, read_checkpoint

    ck = read_checkpoint(path)
    run = _arms_for_this_machine(ck["run"], path)
    if data:
        run = _with_data(run, data)
    dev = resolve_device(device or "auto")
    model = make_model(run.model)
    load_model(model, ck, path)
    model.to(dev)
    t = run.train
    window = t.batch * (t.seq_len + 1)
    for p in data or ():
        size = os.path.getsize(p) if os.path.isfile(p) else None
        if size is not None and size < 2 * window:  # a window of val and one of train
            raise UserError(
                f"--data {p} has {size} bytes; eval scores the checkpoint's windows of "
                f"{t.batch}x({t.seq_len}+1) = {window} bytes on the file's tail, and the split "
                f"needs two of them: give a file of at least {2 * window} bytes"
            )
    source = open_data(run.train)
    # the batches that cover the split once: asking for more scored overlapping windows (each
    # byte ~230 times for --batches 10^9 on a 3,030-byte split), so the whole split is scored
    cover = -(-source.val_bytes_total() // (t.batch * t.seq_len)) if source.has_val else 0
    if batches and batches >= cover:
        log.info(
            f"eval: --batches {batches} is at least the {cover} batches of {t.batch}x"
            f"{t.seq_len} that cover the val split once; scoring the whole split"
        )
        batches = None
    if batches:
        todo = source.val_batches(batches, t.batch, t.seq_len)  # at most the distinct ones
        what = f"{len(todo)} batches of {t.batch}x{t.seq_len} spread over the val split"
    else:
        # the default: every val byte scored once, deterministic
        what = f"the whole val split ({source.val_bytes_total()} bytes scored once)"
        todo = source.val_all(t.batch, t.seq_len)
    log.info(f"eval: {what}; --batches N evaluates N spread batches instead")
    res = evaluate(model, todo, dev, resolve_autocast(run, dev))
    return {**res, "step": ck["step"], "largest": largest_weight(model)}


def cmd_sample(args) -> int:
    import torch

    from .model import make_model
    from .model.sample import check_sample_args, generate
    from .train.run import resolve_device
    from .train.store.checkpoint import load_model, read_checkpoint

    check_sample_args(args.bytes, args.temperature, args.top_k, args.seed)
    if args.device is not None:
        check_device(args.device)
    # argv that is not UTF-8 reaches Python as surrogate escapes: they map back to the very
    # bytes typed, which is what a byte-level model wants
    prompt = args.prompt.encode("utf-8", "surrogateescape")
    ck = read_checkpoint(args.checkpoint)
    model = make_model(_arms_for_this_machine(ck["run"], args.checkpoint).model)
    load_model(model, ck, args.checkpoint)
    device = resolve_device(args.device or "auto")
    model.to(device).eval()
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    # the capacity MoE caps each training window of seq_len bytes: decode with the same rows
    out = generate(model, prompt, args.bytes, temperature=args.temperature, top_k=args.top_k,
                   generator=gen, row_len=ck["run"].train.seq_len)  # fmt: skip
    sys.stdout.write((prompt + out).decode("utf-8", errors="replace") + "\n")
    return 0


def cmd_export(args) -> int:
    from .train.store.checkpoint import read_checkpoint
    from .train.store.folder import export

    out = export(args.run, args.to, overwrite=args.overwrite)
    ck = read_checkpoint(out, mmap=True)
    log.info(
        f"export {args.run} -> {out}: one file (format {ck['format']}, step {ck['step']}, "
        f"{out.stat().st_size / 2**20:.1f} MiB) that eval and sample load anywhere"
    )
    return 0


def cmd_plan(args) -> int:
    run = preset(args.preset)
    run = validate(apply_sets(run, list(args.set or [])))  # d_model=0 was a torch traceback
    if args.routes:
        import torch

        from .model import DormouseModel
        from .train.optim.routing import format_routes, route_params

        with torch.device("meta"):
            model = DormouseModel(run.model)
        log.info(format_routes(route_params(model, opt=run.train.opt)))
    if args.fit is None and (args.world is not None or args.shard is not None):
        raise UserError(
            "plan: --world/--shard plan a fleet's memory and need --fit GB (the "
            "card size, or one per rank: --fit 16,8); add --fit"
        )
    if args.shard is not None:
        from .train.plan.fit import SHARDS

        if args.shard not in SHARDS:
            raise UserError(
                f"--shard {args.shard!r} is not one of {', '.join(SHARDS)} (none = "
                f"DDP, every rank the whole model; fsdp = FSDP2, each rank 1/N)"
            )
        run = apply_sets(run, [f"dist_shard={args.shard}"])
    if args.fit is not None:
        from .train.plan.fit import main_plan

        main_plan(run, args.fit, batch=args.batch, seq=args.seq, world=args.world)
    if not args.routes and args.fit is None:
        from .model import count_params

        log.info(f"{args.preset}: {count_params(run.model) / 1e6:.2f}M parameters")
    return 0


def cmd_probe(args) -> int:
    from .train.plan.device import main_probe

    return main_probe([]) or 0


def cmd_link(args) -> int:
    from .train.fleet.link import main_link

    return main_link(args.rest) or 0


def cmd_compare(args) -> int:
    from .compare import main_compare

    return main_compare(args.runs, args.out, args.target, args.step_ms, args.overwrite)


def cmd_bench(args) -> int:
    from .bench import main_bench

    return main_bench(args.rest) or 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dormouse", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser(
        "train", help="train a preset (on the embedded default corpus unless --data)"
    )
    t.add_argument("preset", choices=preset_names())
    # extend: `--data a --data b` is the mixture of both (the second replaced the first)
    t.add_argument(
        "--data",
        nargs="+",
        action="extend",
        help="byte corpora (any file type); several (in one --data or several) form a mixture",
    )
    t.add_argument("--steps", type=int, help="optimizer steps")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field")
    t.add_argument("--out", help="run folder (checkpoint, metrics.jsonl, loss.png)")
    t.add_argument(
        "--resume",
        nargs="?",
        const="must",
        choices=("never", "auto", "must"),
        help="never (the default): refuse a folder that holds a run; auto: continue "
        "its checkpoint if there is one, else start; must (plain --resume): continue "
        "it, refuse if there is none. Implied auto on an elastic restart",
    )
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a folder that holds a run (its checkpoint is replaced)",
    )
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything (config, device, arms, model, data, run folder), "
        "train nothing, write nothing",
    )
    t.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    t.add_argument("--dist", action="store_true", help="join the fleet (launch with torchrun)")
    t.add_argument("--capacity", help='per-rank micro-batches: "4,2", "4x512,2x512" or auto')
    t.add_argument("--fit", type=float, metavar="GB", help="fit the run into GB of device memory")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint on the validation split")
    e.add_argument("checkpoint")
    e.add_argument("--data", nargs="+", action="extend")
    e.add_argument(
        "--batches",
        type=int,
        help="evaluate N batches spread over the val split "
        "(default: the whole split, every byte once)",
    )
    e.add_argument("--device")
    e.set_defaults(fn=cmd_eval)

    s = sub.add_parser("sample", help="generate bytes from a checkpoint (recurrent decode)")
    s.add_argument("checkpoint")
    s.add_argument("--prompt", default="")
    s.add_argument("--bytes", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device")
    s.set_defaults(fn=cmd_sample)

    c = sub.add_parser("compare", help="two runs' validation curves vs time and bytes, one PNG")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run folders; the last is the baseline")
    c.add_argument("--out", help="the PNG to write (default: RUN_A/compare.png)")
    c.add_argument(
        "--target", type=float, help="the val loss to time (default: the last run's best)"
    )
    c.add_argument(
        "--step-ms",
        metavar="MS,MS",
        help="time each run as steps x this solo step "
        "time (runs that shared a card, timed alone elsewhere)",
    )
    c.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    c.set_defaults(fn=cmd_compare)

    x = sub.add_parser("export", help="one checkpoint file from a run (sharded or not)")
    x.add_argument("run", help="a run folder or its checkpoint file")
    x.add_argument(
        "--to", required=True, help="the file to write (e.g. model.pt), outside every run folder"
    )
    x.add_argument("--overwrite", action="store_true", help="replace --to if it exists")
    x.set_defaults(fn=cmd_export)

    pl = sub.add_parser("plan", help="parameter count, optimizer routes, --fit arithmetic")
    pl.add_argument("preset", choices=preset_names())
    pl.add_argument(
        "--routes", action="store_true", help="print which optimizer owns each parameter"
    )
    pl.add_argument(
        "--fit",
        metavar="GB[,GB...]",
        help="plan into a card of GB (one per rank for a mixed fleet)",
    )
    pl.add_argument(
        "--world",
        type=int,
        metavar="N",
        help="ranks in the fleet (default: one, or one per --fit GB)",
    )
    pl.add_argument(
        "--shard",
        metavar="none|fsdp",
        help="the fleet's sharding: none (DDP) or fsdp (FSDP2); default dist_shard",
    )
    pl.add_argument("--batch", type=int)
    pl.add_argument("--seq", type=int)
    pl.add_argument("--set", action="append", metavar="KEY=VALUE")
    pl.set_defaults(fn=cmd_plan)

    pr = sub.add_parser("probe", help="the device table: name, sm, memory, PCIe, dtype verdict")
    pr.set_defaults(fn=cmd_probe)

    li = sub.add_parser("link", help="the ring all-reduce arithmetic for this machine's link")
    li.add_argument("rest", nargs=argparse.REMAINDER)
    li.set_defaults(fn=cmd_link)

    b = sub.add_parser(
        "bench",
        help="benchmark tables: step (the default; --baseline gpt), optim, "
        "memory, shards, fleet, kernels; warm fills the kernel caches",
    )
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging("stderr" if argv[:1] in (["sample"], ["bench"]) else "stdout")
    # `link` and `bench` own their flags: hand them everything after the subcommand.
    passthrough = {"link": cmd_link, "bench": cmd_bench}
    try:
        if argv and argv[0] in passthrough:
            return passthrough[argv[0]](argparse.Namespace(rest=argv[1:]))
        args = build_parser().parse_args(argv)
        _check_paths(args)
        return args.fn(args)
    except KeyboardInterrupt:
        print("dormouse: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a UserError is one line (cause, fact, escape); anything else a bug
        oom = out_of_memory(e)
        if oom:
            print(f"dormouse: {oom}", file=sys.stderr)
            return 2
        if not isinstance(e, UserError):
            raise
        what = "config error: " if isinstance(e, ConfigError) else ""
        print(f"dormouse: {what}{e}", file=sys.stderr)
        return 2


#: The flags that name a file or folder, checked before any is used (config.check_path).
_PATH_FLAGS = {
    "out": "--out",
    "data": "--data",
    "to": "--to",
    "checkpoint": "the checkpoint",
    "run": "the run",
    "runs": "the run",
}


def _check_paths(args) -> None:
    for key, flag in _PATH_FLAGS.items():
        value = getattr(args, key, None)
        for path in value if isinstance(value, list) else [value]:
            if isinstance(path, str):
                check_path(f"{flag} {path[:40]}{'...' if len(path) > 40 else ''}", path)


def out_of_memory(e: BaseException) -> str:
    """The one line for a device that ran out of memory ("" for any other exception): what
    torch tried to allocate, what this process holds of the card, and the escapes. Not a bug
    of dormouse but a request the card cannot honour, so no traceback (the run folder keeps
    its last checkpoint; `--resume auto` continues from it with the smaller setting)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ""
    text = " ".join(str(e).split())
    if isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in text
    ):
        asked = text.split("you tried to allocate ")[-1].split(".")[0] if "tried" in text else ""
        return (
            f"out of host memory{f' (tried to allocate {asked})' if asked else ''}: the model, "
            f"its optimizer state or the batch does not fit this machine's RAM; lower --set "
            f"batch or seq_len, or a smaller preset (`python -m dormouse plan PRESET` prints "
            f"its parameters and state)"
        )
    if not isinstance(e, torch.cuda.OutOfMemoryError):
        return ""
    # torch's message: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."
    asked = text.removeprefix("CUDA out of memory.").strip().split(". ")[0].rstrip(".")
    held = ""
    with contextlib.suppress(Exception):
        dev = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(dev).total_memory / 2**30
        held = (f"; this process holds {torch.cuda.memory_reserved(dev) / 2**30:.1f} GiB "
                f"(allocated {torch.cuda.memory_allocated(dev) / 2**30:.1f} GiB) of cuda:{dev}'s "
                f"{total:.1f} GiB")  # fmt: skip
    return (
        f"out of memory on the GPU ({asked}{held}): lower --set batch (with --set "
        f"global_batch=G the step keeps G windows as accumulated micro-batches) or --set "
        f"seq_len, or let `--fit GB` choose; compile_mode=reduce-overhead also holds "
        f"CUDA-graph pools (compile_mode=default does not)"
    )
