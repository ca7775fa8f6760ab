"""`python -m dormouse {train,eval,sample,plan,probe,link,bench}`: the command line.

Each subcommand parses its flags and hands off to the module that owns the work;
no training logic lives here.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import ConfigError, apply_sets, preset, preset_names, validate


def _log(line: str) -> None:
    # One write per line: print() writes the text and the newline separately when stdout is
    # unbuffered (PYTHONUNBUFFERED=1), and a fleet's ranks share one pipe, so two ranks'
    # lines could interleave mid-line. A single write under PIPE_BUF bytes stays whole.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _setup_logging() -> None:
    # Module loggers ("dormouse.*") report `auto` choices on stderr, so `sample` prints only
    # the text on stdout.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def _run_from_args(args):
    run = preset(args.preset)
    sets = list(args.set or [])
    if args.steps is not None:
        sets.append(f"steps={args.steps}")
    if getattr(args, "data", None):
        sets.append("data=" + ",".join(args.data))
    if args.out:
        sets.append(f"out_dir={args.out}")
    if args.device:
        sets.append(f"device={args.device}")
    if getattr(args, "dist", False):
        sets.append("dist=true")
    if getattr(args, "capacity", None):
        sets.append(f"dist_capacity={args.capacity}")
    if getattr(args, "fit", None):
        sets.append(f"fit_gb={args.fit}")
    run = apply_sets(run, sets)
    if not args.out and run.train.out_dir == "runs/default":
        run = apply_sets(run, [f"out_dir=runs/{args.preset}"])
    return validate(run)


def cmd_train(args) -> int:
    import torch

    from .model import DormouseModel
    from .train.distributed import check_launch, train_dist

    run = _run_from_args(args)
    dist_mode = check_launch(run.train.dist, os.environ)
    if dist_mode:
        report = train_dist(run, log=_log, resume=args.resume)
    else:
        if run.train.fit_gb:
            from .train.fit import apply_fit

            run = apply_fit(run, log=_log)
        torch.manual_seed(run.train.seed)
        model = DormouseModel(run.model)
        from .train.loop import train

        report = train(model, run, log=_log, resume=args.resume, progress=True)
    if report.get("rank", 0) == 0:
        val = report.get("val") or {}
        start = report.get("val_start") or {}
        if val:
            before = f"{start['bpb']:.4f} -> " if start else ""
            _log(f"done: steps={report['steps']} val_bpb={before}{val['bpb']:.4f} "
                 f"checkpoint={report['checkpoint']}")  # fmt: skip
    return 0


def _arms_for_this_machine(run, source: str):
    """A checkpoint records the kernel arms it was trained with (say kda_impl=fla on a GPU);
    every arm computes the same function (tests/test_kda.py, tests/test_moe.py), so eval and
    sample choose afresh for the device they run on instead of refusing a CPU."""
    from dataclasses import replace

    pinned = {k: getattr(run.model, k) for k in ("kda_impl", "moe_impl")}
    pinned = {k: v for k, v in pinned.items() if v != "auto"}
    if not pinned:
        return run
    said = " ".join(f"{k}={v}" for k, v in pinned.items())
    _log(f"{source}: trained with {said}; the arms compute the same function, so this run "
         f"picks them for its own device ({' '.join(f'{k}=auto' for k in pinned)})")
    return replace(run, model=replace(run.model, **{k: "auto" for k in pinned}))


def cmd_eval(args) -> int:
    from .train.checkpoint import load_model_state, read_checkpoint
    from .train.data import open_data
    from .train.loop import evaluate, resolve_autocast, resolve_device
    from .model import DormouseModel

    ck = read_checkpoint(args.checkpoint)
    run = _arms_for_this_machine(ck["run"], args.checkpoint)
    if args.data:
        run = apply_sets(run, ["data=" + ",".join(args.data)])
    device = resolve_device(args.device or "auto", _log)
    model = DormouseModel(run.model)
    load_model_state(model, ck, args.checkpoint)
    model.to(device)
    data = open_data(run.train, log=_log)
    batches = data.val_batches(args.batches or run.train.eval_batches, run.train.batch, run.train.seq_len)
    res = evaluate(model, batches, device, resolve_autocast(run, device, _log))
    _log(f"eval checkpoint={args.checkpoint} step={ck['step']} loss={res['loss']:.4f} "
         f"bpb={res['bpb']:.4f} tokens={res['tokens']}")  # fmt: skip
    return 0


def cmd_sample(args) -> int:
    import torch

    from .model import DormouseModel
    from .model.sample import generate
    from .train.checkpoint import load_model_state, read_checkpoint
    from .train.loop import resolve_device

    ck = read_checkpoint(args.checkpoint)
    model = DormouseModel(_arms_for_this_machine(ck["run"], args.checkpoint).model)
    load_model_state(model, ck, args.checkpoint)
    device = resolve_device(args.device or "auto", lambda _l: None)
    model.to(device).eval()
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    out = generate(model, args.prompt.encode("utf-8"), args.bytes, temperature=args.temperature,
                   top_k=args.top_k, generator=gen)  # fmt: skip
    sys.stdout.write(args.prompt + out.decode("utf-8", errors="replace") + "\n")
    return 0


def cmd_plan(args) -> int:
    run = preset(args.preset)
    run = apply_sets(run, list(args.set or []))
    if args.routes:
        import torch

        from .model import DormouseModel
        from .train.optim import format_routes, route_params

        with torch.device("meta"):
            model = DormouseModel(run.model)
        _log(format_routes(route_params(model, opt=run.train.opt)))
    if args.fit is not None:
        from .train.fit import main_plan

        main_plan(run, args.fit, batch=args.batch, seq=args.seq, log=_log)
    if not args.routes and args.fit is None:
        from .model import count_params

        _log(f"{args.preset}: {count_params(run.model) / 1e6:.2f}M parameters")
    return 0


def cmd_probe(args) -> int:
    from .train.device import main_probe

    return main_probe([]) or 0


def cmd_link(args) -> int:
    from .train.link import main_link

    return main_link(args.rest) or 0


def cmd_bench(args) -> int:
    from .bench import main_bench

    return main_bench(args.rest) or 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dormouse", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train a preset (on the embedded default corpus unless --data)")
    t.add_argument("preset", choices=preset_names())
    t.add_argument("--data", nargs="+", help="byte corpora (any file type); several form a mixture")
    t.add_argument("--steps", type=int, help="optimizer steps")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field")
    t.add_argument("--out", help="run folder (checkpoint, metrics.jsonl, loss.png)")
    t.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    t.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    t.add_argument("--dist", action="store_true", help="join the fleet (launch with torchrun)")
    t.add_argument("--capacity", help='per-rank micro-batches: "4,2", "4x512,2x512" or auto')
    t.add_argument("--fit", type=float, metavar="GB", help="fit the run into GB of device memory")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint on the validation split")
    e.add_argument("checkpoint")
    e.add_argument("--data", nargs="+")
    e.add_argument("--batches", type=int)
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

    pl = sub.add_parser("plan", help="parameter count, optimizer routes, --fit arithmetic")
    pl.add_argument("preset", choices=preset_names())
    pl.add_argument("--routes", action="store_true", help="print which optimizer owns each parameter")
    pl.add_argument("--fit", type=float, metavar="GB")
    pl.add_argument("--batch", type=int)
    pl.add_argument("--seq", type=int)
    pl.add_argument("--set", action="append", metavar="KEY=VALUE")
    pl.set_defaults(fn=cmd_plan)

    pr = sub.add_parser("probe", help="the device table: name, sm, memory, PCIe, dtype verdict")
    pr.set_defaults(fn=cmd_probe)

    li = sub.add_parser("link", help="the ring all-reduce arithmetic for this machine's link")
    li.add_argument("rest", nargs=argparse.REMAINDER)
    li.set_defaults(fn=cmd_link)

    b = sub.add_parser("bench", help="benchmarks (tokens/s, step ms, memory): tables, not tests")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `link` and `bench` own their flags: hand them everything after the subcommand.
    passthrough = {"link": cmd_link, "bench": cmd_bench}
    if argv and argv[0] in passthrough:
        return passthrough[argv[0]](argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"dormouse: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dormouse: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # user-facing errors from the known families get one clean line
        from .errors import is_user_error

        if is_user_error(e):
            print(f"dormouse: {e}", file=sys.stderr)
            return 2
        raise
