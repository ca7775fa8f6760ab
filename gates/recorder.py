"""What a run records: the loop's callbacks turned into evidence, changing nothing.

`Recorder` hooks the loop's callbacks and keeps what passes (losses, parameter fingerprints,
the skip verdicts, LFB biases, host-RAM Engram tables, the parameters and gradients at steps 0
and 1, state hashes); `plain_tensors` gathers FSDP2 shards for it in one collective per group.
`record_inputs` keeps the windows a model trained on; `no_plot` and `log_lines` quiet the loop's
plot and hand its log lines to a sink.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import torch


def lfb_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().cpu().clone() for n, b in model.named_buffers() if n.endswith("lfb_bias")}


def host_tables(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name.table: CPU copy} of every host-RAM Engram table (engram_ram). They are no
    parameters, so the parameter fingerprint never sees them; empty without engram_ram."""
    from dormouse.model.engram import HostTables

    return {f"{n}.table": m.table.detach().clone() for n, m in model.named_modules()
            if isinstance(m, HostTables)}  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


#: Keys of the optimizer state that the schedule sets every step (not the step's doing).
_SCHEDULE_KEYS = ("lr",)


def _hash_tree(h, obj) -> None:
    """Feed every tensor (local shard of a DTensor) and scalar of a nested state into h."""
    if torch.is_tensor(obj):
        t = _local(obj).to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            if k in _SCHEDULE_KEYS:
                continue
            h.update(repr(k).encode())
            _hash_tree(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _hash_tree(h, v)
    else:
        h.update(repr(obj).encode())


def _digest(*objs) -> str:
    h = hashlib.sha256()
    for o in objs:
        _hash_tree(h, o)
    return h.hexdigest()[:16]


def state_hash(model: torch.nn.Module, opt) -> dict[str, str]:
    """SHA-256 (per component) of everything a step may change on this rank: parameters,
    their gradients (None hashed as such), buffers (LFB counts and biases), host-RAM Engram
    tables with their Adam moments and pending row gradients, and the optimizer's state
    (its lr, which the schedule sets each step, left out). Local, no collective: compared on
    one rank before and after a step."""
    from dormouse.model.engram import HostTables

    params = sorted(model.named_parameters(), key=lambda kv: kv[0])
    hosts = [m for _, m in model.named_modules() if isinstance(m, HostTables)]
    return {
        "parameters": _digest([(n, p) for n, p in params]),
        "gradients": _digest([(n, "none" if p.grad is None else p.grad) for n, p in params]),
        "buffers": _digest(sorted(model.named_buffers(), key=lambda kv: kv[0])),
        "host tables": _digest([m.table for m in hosts]),
        "host row gradients": _digest(
            [[leaf.grad for _, leaf in m._leaves if leaf.grad is not None] for m in hosts]
        ),
        "optimizer": _digest(opt.state_dict()) if opt is not None else "",
    }


def plain_tensors(named) -> dict[str, torch.Tensor]:
    """references.fingerprint's {clean name: full CPU copy}, sorted by name, of (name, tensor)
    pairs, with every FSDP2 shard (a DTensor sharded on dim 0 of a 1-D mesh) gathered in ONE
    all-gather per process group and dtype instead of one full_tensor() each: the same bytes
    (a gather is a copy), so the same fingerprint. A COLLECTIVE like full_tensor(): every rank
    calls it at the same point. (The recorder gathers every parameter after every step, ~48
    tensors: one full_tensor() each cost 3.3 s of a 15 s 2-rank FSDP2 run and 9.7 s of a 28 s
    3-rank one, measured with cProfile on the 2-core box.)"""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from references.fingerprint import _clean

    named = sorted(((_clean(n), t.detach()) for n, t in named), key=lambda kv: kv[0])
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for n, t in named:
        if not hasattr(t, "full_tensor"):
            out[n] = t.to("cpu").contiguous().clone()
        elif t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.ndim >= 1:
            groups.setdefault((t.device_mesh, t.dtype), []).append((n, t))
        else:  # any other layout: torch's own gather, one tensor at a time
            out[n] = t.full_tensor().to("cpu").contiguous().clone()
    for (mesh, dtype), items in groups.items():
        world, me, pg = mesh.size(), mesh.get_local_rank(), mesh.get_group()
        # each rank's rows of each tensor, by torch's own (torch.chunk) rule; the last ranks
        # may hold fewer rows, or none
        sizes = [[Shard.local_shard_size_and_offset(t.shape[0], world, r)[0] for r in range(world)]
                 for _, t in items]  # fmt: skip
        rows = [math.prod(t.shape[1:]) for _, t in items]
        span = [max(s) * w for s, w in zip(sizes, rows)]  # one rank's padded piece per tensor
        local = [t.to_local() for _, t in items]
        for (n, t), loc, s in zip(items, local, sizes):
            if loc.shape[0] != s[me]:
                raise RuntimeError(
                    f"{n}: rank {me} holds {loc.shape[0]} rows of {t.shape[0]}, "
                    f"torch.chunk gives {s[me]}: not FSDP2's dim-0 sharding"
                )
        send = torch.zeros(sum(span), dtype=dtype, device=local[0].device)
        at = 0
        for loc, L in zip(local, span):
            send[at : at + loc.numel()] = loc.reshape(-1)
            at += L
        recv = torch.empty(world * send.numel(), dtype=dtype, device=send.device)
        with warnings.catch_warnings():  # torch 2.13 renames it; 2.11 (the GPU box) has no new name
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(recv, send, group=pg)
        recv = recv.view(world, -1).to("cpu")
        at = 0
        for (n, t), s, w, L in zip(items, sizes, rows, span):
            out[n] = torch.cat([recv[r, at : at + s[r] * w] for r in range(world)]).view(t.shape)
            at += L
    return {n: out[n] for n, _ in named}


class Recorder:
    """Records a run through the loop's callbacks (`dormouse.train.step.Callbacks`); changes
    nothing.

    after_backward runs once per step after backward, the reductions, the clip and the
    agreed finiteness verdict, before the optimizer, so the parameters it sees are those after
    the previous step: call k records the state after k steps (and, at the snap steps, step
    k's reduced gradient). after_step runs at the end of every step, taken or skipped: it
    records the pre-clip global gradient norm and, with states=True, a hash of this rank's
    whole training state. (A fingerprint under FSDP2 is a collective; every rank records at
    the same point.)
    """

    snap_steps = (0, 1)

    def __init__(self, journal: Path | None = None, probe=None, states: bool = False):
        #: a file each step's verdict (and, with states, state hash) is appended to as it
        #: happens, so a rank that dies mid-run (a C++ abort cannot be caught) still leaves
        #: its evidence
        self.journal, self.probe, self.states = journal, probe, states
        self.model = self.net = self.opt = self.ctx = None
        self.rec = {"fingerprints": [], "decisions": [], "losses": [], "local_losses": [],
                    "lfb": [], "params": {}, "grads": {}, "probe": [],
                    "host_fingerprints": [], "host": {}, "gnorms": [], "states": [],
                    "scales": [], "evals": []}  # fmt: skip

    def callbacks(self):
        from dormouse.train.step import Callbacks

        return Callbacks(after_backward=self.after_backward, after_step=self.after_step,
                         on_log=self.on_log, on_eval=self.on_eval)  # fmt: skip

    def on_eval(self, info: dict) -> None:
        """(step, loss, bpb, val bytes) of each evaluation, where this rank has the result."""
        if info.get("val"):
            v = info["val"]
            self.rec["evals"].append((info["step"], v["loss"], v["bpb"], v["tokens"]))

    def _seen(self, info: dict) -> None:
        self.model, self.net, self.opt, self.ctx = (info["model"], info["net"], info["opt"],
                                                    info["ctx"])  # fmt: skip

    def after_backward(self, info: dict) -> None:
        from references.fingerprint import fingerprint_params

        self._seen(info)
        rec, model = self.rec, self.model
        k = len(rec["decisions"])
        params = plain_tensors(model.named_parameters())
        rec["fingerprints"].append(fingerprint_params(params))
        rec["lfb"].append(lfb_biases(model))
        host = host_tables(model)
        rec["host_fingerprints"].append(fingerprint_params(host) if host else None)
        if k in self.snap_steps:
            rec["params"][k] = params
            rec["host"][k] = host
            rec["grads"][k] = plain_tensors((n, p.grad) for n, p in model.named_parameters()
                                            if p.grad is not None)  # fmt: skip
        if self.probe is not None:
            rec["probe"].append(self.probe(k, model))
        rec["decisions"].append((bool(info["local"]), bool(info["agreed"])))
        self._journal({"k": k, "local": bool(info["local"]), "agreed": bool(info["agreed"])})

    def _journal(self, row: dict) -> None:
        if self.journal is not None:
            import json

            with open(self.journal, "a") as f:
                f.write(json.dumps(row) + "\n")

    def after_step(self, info: dict) -> None:
        self._seen(info)
        self.rec["gnorms"].append(float(info["gnorm"]))
        self.rec["scales"].append(info.get("scale"))
        if self.states:
            self.rec["states"].append(state_hash(self.model, self.opt))
            self._journal({"state": self.rec["states"][-1]})

    def on_log(self, info: dict) -> None:
        self.rec["losses"].append(info["loss"])
        self.rec["local_losses"].append(info["local_loss"])

    def finish(self) -> dict:
        from dormouse.train.store.checkpoint import optimizer_state
        from references.fingerprint import fingerprint_params

        rec = self.rec
        rec["final_params"] = plain_tensors(self.model.named_parameters())
        rec["final_fingerprint"] = fingerprint_params(rec["final_params"])
        rec["final_lfb"] = lfb_biases(self.model)
        rec["final_host"] = host_tables(self.model)
        rec["final_host_fingerprint"] = (fingerprint_params(rec["final_host"])
                                         if rec["final_host"] else None)  # fmt: skip
        # The full optimizer state as a checkpoint would hold it (a collective under FSDP2;
        # rank 0 holds it, other ranks may get {}).
        rec["final_opt"] = optimizer_state(self.net, self.opt) if self.opt is not None else {}
        return rec


def read_journal(path: Path) -> dict:
    """What a rank that died left in its journal: the verdicts and state hashes it recorded."""
    import json

    rec = {"decisions": [], "states": []}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "agreed" in row:
                rec["decisions"].append((row["local"], row["agreed"]))
            else:
                rec["states"].append(row["state"])
    return rec


def record_inputs(model: torch.nn.Module, sink: list) -> None:
    """Append the bytes of every training forward's input x to `sink` (uint8 [B, T] arrays):
    which windows this process trained on, step by step."""
    orig = model.forward

    # outside dynamo: traced, the append would make every compiled forward guard on
    # len(sink) and recompile at each step (8 times a rank, then run that frame eagerly)
    @torch.compiler.disable
    def keep(x):
        sink.append(x.detach().to("cpu", torch.uint8).numpy().copy())

    def forward(x, y=None, *args, **kwargs):
        if model.training and y is not None:
            keep(x)
        return orig(x, y, *args, **kwargs)

    model.forward = forward


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far: 0 means compile=true compiled nothing
    (a wrapper dynamo skips whole would still train, eagerly, and pass any trajectory check)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def no_plot(skip: bool = True):
    """Inside the block the loop does not draw its loss curve (loss.png, rank 0's last act of
    every run: 0.15-0.45 s each, measured, over a hundred runs a session), for the gates that
    never look at it; dormouse itself always plots. Gate 8, which lists what rank 0 wrote,
    keeps it (FleetSpec.plot)."""
    from dormouse.train import loop

    real = loop._plot
    if skip:
        loop._plot = lambda *a: None
    try:
        yield
    finally:
        loop._plot = real


@contextlib.contextmanager
def log_lines(sink: Callable[[str], None], name: str = "dormouse", ranked: bool = False):
    """Hand every line logger `name` emits at INFO or above inside the block to `sink`.
    `ranked`: only what the CLI would print on this rank (its rank filter: INFO from rank 0
    only, warnings and every-rank lines from all)."""
    import logging

    class Sink(logging.Handler):
        def emit(self, record):
            sink(self.format(record))

    handler = Sink(logging.INFO)
    if ranked:
        from dormouse.cli import _RankFilter

        handler.addFilter(_RankFilter())
    logger = logging.getLogger(name)
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
