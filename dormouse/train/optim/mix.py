"""MixOptimizer: Muon for hidden matrices, AdamW for the rest, Engram tables in their own group.

One torch.optim.Optimizer over three kinds of group, built from `routing.route_params`:

* Muon (`dormouse.train.optim.muon`), batched: one group per matrix shape [R, C] (a 2D weight, or one
  expert of a 3D [E, R, C] stack), whose momentum is one flat tensor (the [N, R, C] stack in
  one process, the local shards' elements under FSDP2) and whose Newton-Schulz polar runs as
  one batched call on whole matrices (under FSDP2 gathered by one all-gather per group).
* AdamW: `torch.optim.AdamW` (or bitsandbytes' AdamW8bit), never hand-written; its group dicts
  are this optimizer's own.
* Engram: the row-sparse Adam of `dormouse.train.optim.rowadam` (lazy, per-row bias correction, no
  weight decay) over the VRAM tables (`*store.table` parameters) and the host-RAM stores
  (`HostTables`, engram_ram), so both stores follow the same trajectory.

State is torch's: `self.state[p]` for every parameter, made at construction. (torch's
optimizers make it at the first step; torch.distributed.checkpoint's state_dict functions,
finding it empty, would take a zero-gradient step to make it, decaying every moment.) AdamW's
entries (the inner AdamW steps this very dict), Muon's momentum_buffer as a view of its group's
stack (under FSDP2 a DTensor placed like its parameter, over a view of the local stack), a VRAM
table's `row_state`. The host tables' rows are no parameters: their row state is
`host_state`, by table name, under "host" in state_dict().

Learning-rate convention for the loop: every param group carries `base_lr` (set once at
construction: `lr`, or `lr * engram_lr_mult` for the Engram group) and `lr`, the value used
by the next `step()`. The loop calls `opt.set_lr_factor(f)` each step, which sets
`group["lr"] = group["base_lr"] * f` on every group (Muon and AdamW alike). Muon's weight
decay uses the scheduled `lr` (p *= 1 - lr*wd), as torch.optim.Muon and AdamW do.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import Tensor, nn

from ...config import ConfigError, Optim, TrainConfig
from ...model.engram import HostTables, touched_rows
from ..context import local_shard
from .graph import GRAPH_WARMUP, StepGraph
from .muon import DTYPES, muon_step_
from .quant import BLOCK
from .routing import Route, route_params, strip_name
from .rowadam import moments, row_adam_, row_adam_dense_, row_state

log = logging.getLogger(__name__)

#: Group entries a load leaves as built: the kernel choice is this machine's, not the run's.
_KEEP_ON_LOAD = ("params", "fused", "foreach")


def _check_sharding(name: str, p: Tensor) -> None:
    """Muon's gather knows one layout: FSDP2's default, dim 0 sharded over a 1-D mesh."""
    if not hasattr(p, "placements"):
        return
    from torch.distributed.tensor import Shard

    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ConfigError(
            f"Muon steps FSDP2 parameters sharded on dim 0 over a 1-D mesh; {name} is placed "
            f"{tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh. Shard with fully_shard's "
            f"default placement, or use --set opt=adamw"
        )


def _resolve_ns_dtype(ns_dtype: str, device_type: str) -> str:
    if ns_dtype != "auto":
        return ns_dtype
    chosen = "bf16" if device_type == "cuda" else "fp32"
    why = (
        "tensor cores run the polar in bf16"
        if chosen == "bf16"
        else (f"device {device_type!r}: bf16 matmuls are slower than fp32 there")
    )
    log.info(f"ns_dtype=auto -> {chosen} ({why})")
    return chosen


def _refuse_sharded_int8(named: list, muon_state_dtype: str, engram_state_dtype: str) -> None:
    """int8 state is kept per process in blocks of the local elements; an FSDP2 shard's would
    have to be resharded through fp32 whenever the world size changes (nothing does that)."""
    on = [
        r.name
        for r, p in named
        if hasattr(p, "placements")
        and (
            (r.owner == "muon" and muon_state_dtype == "int8")
            or (r.owner == "engram" and engram_state_dtype == "int8")
        )
    ]
    if on:
        raise ConfigError(
            f"muon_state_dtype={muon_state_dtype}, engram_state_dtype={engram_state_dtype}: "
            f"int8 optimizer state is not implemented for FSDP2 shards ({len(on)} sharded "
            f"parameters, first {on[0]}); use --set muon_state_dtype=bf16 --set "
            f"engram_state_dtype=bf16, or --set dist_shard=none (DDP)"
        )


class MixOptimizer(torch.optim.Optimizer):
    """Muon (batched by matrix shape) + torch AdamW, behind one torch.optim.Optimizer surface.

    `param_groups` holds the Muon groups first (kind="muon", one per matrix shape/dtype/device),
    then the AdamW groups (kind "adamw", "adamw_nodecay"), then one Engram group (kind
    "engram"); each group's "names" lists its parameters' canonical names. See the module
    docstring for the state and the lr convention (`base_lr`, `set_lr_factor`).

    The Engram group's "params" are the VRAM tables; its "names" also list the host-RAM
    tables (`HostTables` modules, found at construction), whose rows are not parameters.
    Both are stepped by `row_adam_`: only rows whose gradient is non-zero move (their m, v,
    step count and the row itself), with lr = group lr (base lr x engram_lr_mult, scheduled
    by set_lr_factor), betas = adam_betas, eps = adam_eps, no weight decay.

    `muon_state_dtype="bf16"` stores the stacked momentum in bf16: half the memory, and
    APPROXIMATE by design (it drifts from the fp32 trajectory by bf16 round-off).
    `engram_state_dtype="bf16"` does the same for the Engram tables' Adam moments (computed
    in fp32, stored in bf16): the bulk of b1's optimizer state. "int8" stores either as 8-bit
    codes with an fp32 scale per block (`dormouse.train.optim.quant`: 256-value blocks of the
    momentum, one table row for the moments), about a quarter of fp32 and as approximate;
    its state entries are the codes and scales (momentum_q/momentum_absmax; exp_avg_q,
    exp_avg_absmax, exp_avg_sq_q, exp_avg_sq_sqrtmax), plain tensors that a checkpoint saves
    and loads bit for bit. Not under FSDP2 (refused): a sharded int8 momentum would be
    resharded through fp32 on a resume at another world size, which nothing here does.
    """

    def __init__(self, model: nn.Module, cfg: Optim):
        """`cfg`: the optimizer's part of the run's config (`run.train.optim`); its rules are
        Optim.check's (config.py), run here for an optimizer built without a run."""
        cfg.check()
        opt, lr, wd, ns_dtype = cfg.opt, cfg.lr, cfg.wd, cfg.ns_dtype
        muon_state_dtype, engram_state_dtype = cfg.muon_state_dtype, cfg.engram_state_dtype
        adam_betas, adam_eps = tuple(cfg.adam_betas), cfg.adam_eps
        self.cfg = cfg
        self._engram_state_dtype = engram_state_dtype
        self.optim_8bit = cfg.optim_8bit
        self.routes = route_params(model, opt)
        named = [(r, p) for r, (_, p) in zip(self.routes, model.named_parameters(), strict=True)]

        muon = [(r, p) for r, p in named if r.owner == "muon"]
        if muon and ns_dtype == "auto":
            ns_dtype = _resolve_ns_dtype(ns_dtype, muon[0][1].device.type)
        for r, p in muon:
            _check_sharding(r.name, p)

        # ---- Muon groups: one per (matrix shape, dtype, device) ----
        buckets: dict[tuple, list[tuple[Route, Tensor]]] = {}
        for r, p in muon:
            buckets.setdefault((r.matrix, p.dtype, str(p.device)), []).append((r, p))
        groups: list[dict] = []
        for (mat, _dt, _dev), members in buckets.items():
            groups.append(
                {
                    "params": [p for _, p in members],
                    "names": [r.name for r, _ in members],
                    "kind": "muon",
                    "lr": lr,
                    "base_lr": lr,
                    "weight_decay": wd,
                    "momentum": cfg.muon_momentum,
                    "nesterov": cfg.muon_variant == "nesterov",
                    "ns_steps": cfg.ns_steps,
                    "ns_kind": cfg.ns_kind,
                    "ns_dtype": ns_dtype,
                    "muon_sf": cfg.muon_sf,
                    "matrix": mat,
                }
            )

        # ---- AdamW groups ----
        adam_specs = (
            ("adamw", lambda r: r.owner == "adamw" and r.decay, lr, wd),
            ("adamw_nodecay", lambda r: r.owner == "adamw" and not r.decay, lr, 0.0),
        )
        adam_groups = []
        for kind, pick, glr, gwd in adam_specs:
            sel = [(r, p) for r, p in named if pick(r)]
            if sel:
                adam_groups.append(
                    {
                        "params": [p for _, p in sel],
                        "names": [r.name for r, _ in sel],
                        "kind": kind,
                        "lr": glr,
                        "base_lr": glr,
                        "weight_decay": gwd,
                    }
                )
        self.adamw = (
            self._make_adamw(adam_groups, lr, tuple(adam_betas), adam_eps) if adam_groups else None
        )

        # ---- the Engram group: VRAM tables (parameters) and host stores (not) ----
        vram = [(r, p) for r, p in named if r.owner == "engram"]
        self._host: list[tuple[str, HostTables]] = [
            (strip_name(n) + ".table", m)
            for n, m in model.named_modules()
            if isinstance(m, HostTables)
        ]
        engram = []
        if vram or self._host:
            glr = lr * cfg.engram_lr_mult
            engram = [
                {
                    "params": [p for _, p in vram],
                    "names": [r.name for r, _ in vram] + [n for n, _ in self._host],
                    "kind": "engram",
                    "lr": glr,
                    "base_lr": glr,
                    "weight_decay": 0.0,
                    "betas": tuple(adam_betas),
                    "eps": adam_eps,
                }
            ]

        self._muon_groups = groups
        all_groups = groups + (self.adamw.param_groups if self.adamw is not None else []) + engram
        if not all_groups:
            raise ConfigError("the model has no parameters to optimise")
        super().__init__(all_groups, {"lr": lr})
        self._sealed = True  # Optimizer.__init__ used add_param_group; nobody else may
        self._graph: StepGraph | None = None
        self._engram_group = self.param_groups[-1] if engram else None
        if "int8" in (muon_state_dtype, engram_state_dtype):
            _refuse_sharded_int8(named, muon_state_dtype, engram_state_dtype)
        self._init_state(muon_state_dtype)

    # ---- construction helpers ----

    def _make_adamw(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float):
        params = [p for g in groups for p in g["params"]]
        if self.optim_8bit:
            try:
                import bitsandbytes as bnb
            except ImportError as e:
                raise ConfigError(
                    f"optim_8bit=true needs bitsandbytes, which does not import here ({e}); "
                    f"install it with `pip install bitsandbytes` (CUDA only) or run with "
                    f"--set optim_8bit=false"
                ) from None
            off = sorted({p.device.type for p in params if p.device.type != "cuda"})
            if off:
                raise ConfigError(
                    f"optim_8bit=true: bitsandbytes' AdamW8bit (package bitsandbytes) steps "
                    f"CUDA tensors only, but AdamW parameters live on {off}; run on a CUDA "
                    f"device or use --set optim_8bit=false"
                )
            return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=eps)
        all_cuda = all(p.device.type == "cuda" for p in params)
        # fused on CUDA (one kernel for all; FSDP2's DTensor shards too: AdamW is elementwise,
        # and one process and a sharded fleet then run the same arithmetic, which gate g12
        # measured apart by 10x its round-off spread with foreach on the fleet, on an H200);
        # foreach on the CPU.
        if all_cuda:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)

    @torch.no_grad()
    def _init_state(self, muon_state_dtype: str) -> None:
        """Every parameter's state, and the host tables' (see the module docstring)."""
        # (flat momentum, offsets, None) or, for int8, (codes [blocks, BLOCK], block offsets,
        # absmax [blocks]): muon_step_'s arguments
        self._stacks: list[tuple[Tensor, list[int], Tensor | None]] = []
        for g in self._muon_groups:
            sizes = [local_shard(p).numel() for p in g["params"]]
            dev = g["params"][0].device
            if muon_state_dtype == "int8":
                # each parameter's elements start a block (its last block padded), so its
                # codes and scales are slices of its own: state by parameter, as torch keeps it
                blocks = [-(-n // BLOCK) for n in sizes]
                offsets = [sum(blocks[:i]) for i in range(len(blocks) + 1)]
                codes = torch.zeros(offsets[-1], BLOCK, dtype=torch.int8, device=dev)
                absmax = torch.zeros(offsets[-1], dtype=torch.float32, device=dev)
                self._stacks.append((codes, offsets, absmax))
                for p, a, b in zip(g["params"], offsets, offsets[1:]):
                    self.state[p].update(momentum_q=codes[a:b], momentum_absmax=absmax[a:b])
                continue
            offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            buf = torch.zeros(offsets[-1], dtype=DTYPES[muon_state_dtype], device=dev)
            self._stacks.append((buf, offsets, None))
            for p, a, b in zip(g["params"], offsets, offsets[1:]):
                self.state[p]["momentum_buffer"] = _placed_like(p, buf[a:b])
        if self.adamw is not None:
            self.adamw.state = self.state
            for gi, g in enumerate(self.adamw.param_groups):
                for pi, p in enumerate(g["params"]):
                    if self.optim_8bit:
                        self.adamw.init_state(g, p, gi, pi)  # what its first step would make
                        continue
                    # torch AdamW's first step would make these (its step counter: fp32, on the
                    # device when fused, else on the CPU)
                    dev = p.device if g["fused"] else "cpu"
                    self.state[p].update(
                        step=torch.zeros((), dtype=torch.float32, device=dev),
                        exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                        exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                    )
        if self._engram_group is not None:
            for p in self._engram_group["params"]:
                self.state[p].update(row_state(p, self._engram_state_dtype))
        self.host_state = {
            name: row_state(store.table, self._engram_state_dtype) for name, store in self._host
        }

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_sealed", False):
            raise NotImplementedError(
                "MixOptimizer routes parameters itself; build a new one from the model instead"
            )
        super().add_param_group(param_group)

    # ---- public surface ----

    @classmethod
    def from_config(
        cls, model: nn.Module, train_cfg: TrainConfig, device_type: str
    ) -> MixOptimizer:
        """Build from a TrainConfig; ns_dtype="auto" -> bf16 on cuda, fp32 elsewhere (logged).
        compile_mode=reduce-overhead on CUDA also captures the optimizer step in a CUDA graph
        (`capture_step`; logged, with the reason when it cannot)."""
        t, o = train_cfg, train_cfg.optim
        ns_dtype = (
            _resolve_ns_dtype(o.ns_dtype, device_type)
            if o.opt == "mix"
            else ("fp32" if o.ns_dtype == "auto" else o.ns_dtype)
        )
        opt = cls(model, replace(o, ns_dtype=ns_dtype))
        if t.compile and t.compile_mode == "reduce-overhead" and device_type == "cuda":
            why = opt.capture_step()
            log.info(
                "compile_mode=reduce-overhead: the optimizer step "
                + (
                    f"stays eager: {why}"
                    if why
                    else f"is captured in a CUDA graph after {GRAPH_WARMUP} eager steps and kept if "
                    f"its replay is not slower than the eager step (both timed, logged)"
                )
            )
        return opt

    def set_lr_factor(self, factor: float) -> None:
        """group["lr"] = group["base_lr"] * factor on every group (the loop's schedule)."""
        for g in self.param_groups:
            g["lr"] = g["base_lr"] * factor

    @torch.no_grad()
    def step(self, closure=None, commit: Tensor | None = None):
        """One step. `commit` (a bool tensor, the loop's finiteness verdict left on the device):
        the step is taken only where it holds. After `commit_on_device` the device step
        applies it without the host: every tensor the step writes is copied aside first and
        put back where `commit` is False (`StepGraph.transact`); any other path reads it on
        the host first (one synchronisation) and steps or not."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._graph is not None:
            self._graph.step(commit)
        elif commit is None or bool(commit):
            self._step_body(None)
        return loss

    @property
    def device_side(self) -> bool:
        """Whether step() runs its device-side form (`capture_step`: a CUDA graph, or that
        arithmetic eagerly), the one that can take the verdict on the device."""
        return self._graph is not None

    def commit_on_device(self) -> str:
        """From the next step on, step(commit=...) decides on the device (see step): "" when
        on, else why it cannot be. Needs the device-side step (`capture_step`), before its
        capture; the copy aside costs `written_bytes()` of device memory."""
        g = self._graph
        if g is None:
            return (
                "the optimizer steps on the host (its device-side step comes with "
                "compile_mode=reduce-overhead on CUDA, or verdict=device)"
            )
        if g.graph is not None:
            return "the optimizer graph was captured already, without the copy aside"
        g.transact = True
        return ""

    def written(self) -> list[Tensor]:
        """Every tensor a step writes: the parameters, Muon's stacked momentum, AdamW's and the
        Engram tables' state (the host tables' state is on the CPU: never on the device path)."""
        params = [p for g in self.param_groups for p in g["params"]]
        out = {id(p): p for p in params}
        for buf, _, absmax in self._stacks:  # Muon's momentum: the stacks, not their views
            out.update({id(t): t for t in (buf, absmax) if t is not None})
        views = ("momentum_buffer", "momentum_q", "momentum_absmax")
        for p in params:
            out.update(
                {
                    id(v): v
                    for k, v in self.state[p].items()
                    if torch.is_tensor(v) and k not in views
                }
            )
        return list(out.values())

    def written_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.written())

    def _step_body(self, lrs: Tensor | None) -> None:
        """The step. `lrs` (graph mode): every group's lr, in param_groups' order, as one
        float64 tensor on the device (the floats in param_groups are copied into it before
        each replay), so nothing the step launches reads a host value that changes."""
        for i, (g, stack) in enumerate(zip(self._muon_groups, self._stacks, strict=True)):
            muon_step_(g, *stack, lr_t=None if lrs is None else lrs[i])
        if self.adamw is not None:
            if lrs is None or not self.adamw.param_groups[0].get("fused"):
                self.adamw.step()  # (foreach AdamW, the CPU's, takes no tensor lr)
            else:
                self._adamw_step_on(lrs)
        if self._engram_group is not None:
            self._engram_step(self._engram_group, None if lrs is None else lrs[-1])

    def _adamw_step_on(self, lrs: Tensor) -> None:
        """torch's fused AdamW reading lr from the device (fp32, as it reads a float lr), for
        the length of one step; param_groups keep their floats for every other reader."""
        first = len(self._muon_groups)
        groups = self.adamw.param_groups
        lr32 = lrs[first : first + len(groups)].to(torch.float32)
        floats = [g["lr"] for g in groups]
        try:
            for g, t in zip(groups, lr32.unbind(0)):
                g["lr"] = t
            self.adamw.step()
        finally:
            for g, f in zip(groups, floats):
                g["lr"] = f

    def _engram_step(self, g: dict, lr_t: Tensor | None = None) -> None:
        hyper = (g["lr"], tuple(g["betas"]), g["eps"])
        for p in g["params"]:
            if p.grad is None:
                continue
            if lr_t is not None:  # graph mode: rows by mask, no host synchronisation
                st = self.state[p]
                row_adam_dense_(
                    p, st["exp_avg"], st["exp_avg_sq"], st["step"], p.grad, lr_t, *hyper[1:]
                )
                continue
            grad = local_shard(p.grad).reshape(-1, p.shape[-1])
            rows = touched_rows(grad)
            if rows.numel():
                st = self.state[p]
                m, v, scales = moments(st)
                mine = (local_shard(t) for t in (p, m, v, st["step"]))
                row_adam_(*mine, rows, grad.index_select(0, rows), *hyper, scales=scales)
        for name, store in self._host:
            rows, grad = store.pending()
            store.zero_grad()  # the cycle ends here, with or without rows to step
            if rows.numel():
                st = self.host_state[name]
                m, v, scales = moments(st)
                row_adam_(
                    store.table,
                    m,
                    v,
                    st["step"],
                    rows,
                    grad.to("cpu", torch.float32),
                    *hyper,
                    scales=scales,
                )

    # ---- the step as one CUDA graph ----

    def capture_step(
        self, warmup: int = GRAPH_WARMUP, capture: bool = True, keep: str = "auto"
    ) -> str:
        """From now on step() replays one CUDA graph of the whole optimizer step (every Muon
        group's momentum and polar, the fused AdamW, the Engram rows) instead of launching
        its ~500 kernels one by one from Python: `warmup` eager steps, then a capture, then
        a replay per step. Returns "" when on, else why it cannot be (nothing changes then).
        keep="auto": the eager steps of the warm-up (all but the first) and the first
        GRAPH_TIMED replays are timed, the device synchronised around each, and the graph is
        dropped (the eager step from then on) when its replay is slower than GRAPH_KEEP x the
        eager step; both medians and the choice are logged. keep="always": no timing.

        What the graph reads that changes between steps lives on the device: the learning
        rates (one float64 tensor written before each replay), AdamW's step counters (fused:
        on the device already), the Engram rows to step (picked by a mask: `row_adam_dense_`,
        where the eager step asks `nonzero`). The gradients are copied into the tensors the
        graph was captured on (one foreach copy); a step whose parameters with a gradient
        are not the captured ones runs eagerly (the same arithmetic). The graph keeps the
        step's temporaries (the polar's workspace) reserved in its own memory pool.
        `capture=False` runs that device-side arithmetic eagerly, on any device (the tests
        compare it with the host-side step on the CPU)."""
        why = self._graph_refusal(capture)
        if why:
            return why
        if keep not in ("auto", "always"):
            raise ValueError(f"capture_step(keep={keep!r}): 'auto' or 'always'")
        self._graph = StepGraph(self, warmup if capture else None, timed=keep == "auto")
        return ""

    def _graph_refusal(self, capture: bool) -> str:
        params = [p for g in self.param_groups for p in g["params"]]
        devices = sorted({str(p.device) for p in params})
        if capture and (len(devices) != 1 or not devices[0].startswith("cuda")):
            return f"the parameters live on {devices}, not on one CUDA device"
        if any(hasattr(p, "placements") for p in params):
            return "FSDP2 shards (DTensors) step through collectives"
        if self._host:
            return "host-RAM Engram tables (engram_ram) step on the CPU"
        if self.optim_8bit:
            return "optim_8bit: bitsandbytes' AdamW8bit is not captured"
        if any(absmax is not None for _, _, absmax in self._stacks):
            return "muon_state_dtype=int8: its blockwise codes step eagerly"
        if self._engram_group is not None and self._engram_state_dtype == "int8":
            return "engram_state_dtype=int8: its row codes step eagerly"
        return ""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad over every group, and the end of the host stores' cycle."""
        super().zero_grad(set_to_none)
        for _, store in self._host:
            store.zero_grad()

    @torch.no_grad()
    def unscale_(self, inverse: float) -> None:
        """Multiply every gradient this optimizer steps by `inverse` (the loss scaler's
        1/scale, a power of two: exact), host-table rows included: they are no parameters,
        so a loop over param_groups alone would leave them scale times too large."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        for _, store in self._host:
            holder = store.consolidate()
            if holder is not None:
                grads.append(holder.grad)
        # torch's foreach kernels take DTensors or plain tensors, not both in one list
        for on_mesh in (True, False):
            group = [t for t in grads if hasattr(t, "placements") == on_mesh]
            if group:
                torch._foreach_mul_(group, inverse)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """torch.nn.utils.clip_grad_norm_ (2-norm) over every gradient this optimizer steps,
        host-table rows included; returns the total norm, as torch does.

        The loop should clip through this rather than over model.parameters(): that list
        misses the host rows, and even with them the two stores would sum the table's
        squares differently (a dense table gradient with its zero rows against a compact
        one), so a clip that fires would round differently and the runs drift apart. Here
        every Engram table enters the norm as its touched rows, summed per row, in
        ascending order: the same numbers in the same order in both stores. Everything
        else (all other gradients, the clip coefficient, the scaling) is torch's own code.
        An FSDP2-sharded table enters whole (its gradient is a DTensor; the norm must be
        the fleet's), as it would in torch's clip; under FSDP2 the norm is the DTensors'
        (a collective) joined with the host rows' (counted once: every rank holds the same).
        With the device-side step (`capture_step`: no host tables) a VRAM table enters whole,
        its untouched rows as zeros: the same norm without `nonzero`'s wait for the device,
        summed in another order (an ulp apart from the touched rows' sum).
        """
        eg = self._engram_group
        # the device-side step picks the rows to step by mask; the norm needs no rows either
        tables = {id(p) for p in eg["params"]} if eg is not None and self._graph is None else set()
        owners = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm_of = [p.grad for p in owners if id(p) not in tables]
        for p in owners:
            if id(p) in tables:
                if hasattr(p.grad, "placements"):
                    norm_of.append(p.grad)
                else:
                    flat = p.grad.reshape(-1, p.shape[-1])
                    norm_of.append(flat.index_select(0, touched_rows(flat)))
        for _, store in self._host:
            holder = store.consolidate()
            if holder is not None:
                owners.append(holder)
                norm_of.append(holder.grad)
        sharded = [t for t in norm_of if hasattr(t, "placements")]
        if not sharded:
            total = torch.nn.utils.get_total_norm(norm_of, 2.0)
            torch.nn.utils.clip_grads_with_norm_(owners, max_norm, total)
            return total
        # FSDP2: torch's functions take DTensors or plain tensors, not both ("_foreach_norm got
        # mixed torch.Tensor and DTensor"). The DTensors' norm is a collective over their
        # shards; the host rows are plain and already the fleet's on every rank
        # (DPContext.reduce_host_grads), so their squares enter once, from this rank.
        parts = [torch.nn.utils.get_total_norm(sharded, 2.0).full_tensor()]
        rest = [t for t in norm_of if not hasattr(t, "placements")]
        if rest:
            parts.append(torch.nn.utils.get_total_norm(rest, 2.0))
        total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), 2.0)
        for on_mesh in (True, False):
            group = [p for p in owners if hasattr(p, "placements") == on_mesh]
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    # ---- state ----

    def state_dict(self) -> dict:
        """torch's format ("state" by parameter index, "param_groups"), and "host": the host
        tables' row state by table name, when the model has any.

        The tensors are the live ones, as in torch: torch.save it (or deepcopy it) before
        stepping again if it must stay a snapshot.
        """
        sd = super().state_dict()
        if self.host_state:
            sd["host"] = self.host_state
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a state in: one from state_dict(), or torch.distributed.checkpoint's (keyed by
        parameter name; "host", when present, goes to load_host_state). Refuses one saved for
        another routing or optimizer.

        Copies, never adopts: a Muon momentum stays a view of its stack, every tensor keeps
        this optimizer's dtype and device (a fused AdamW's step counters stay on the device,
        where a state saved by a foreach AdamW, or passed through torch.distributed.checkpoint,
        has them on the CPU), and the caller's dict is left as it was. As in torch, the saved
        group hyperparameters (lr, base_lr, wd, ...) win over the constructor's; the loop's
        next set_lr_factor recomputes lr from base_lr.
        """
        sd = state_dict
        if not isinstance(sd, dict) or "param_groups" not in sd:
            keys = sorted(sd)[:6] if isinstance(sd, dict) else type(sd).__name__
            raise ConfigError(
                f"not a torch optimizer state (it has {keys}): the checkpoint "
                f"was written by another optimizer or dormouse version"
            )
        saved = sd["param_groups"]
        mine = [g["names"] for g in self.param_groups]
        theirs = [list(g.get("names", ())) for g in saved]
        ids = [i for g in saved for i in g["params"]]
        params = [(n, p) for g in self.param_groups for n, p in zip(g["names"], g["params"])]
        if mine != theirs or len(ids) != len(params):
            raise ConfigError(
                f"optimizer state does not match this model's routing "
                f"({_first_difference(mine, theirs)}); the checkpoint is from a different model "
                f"shape, --set opt or dormouse version"
            )
        for i, (name, p) in zip(ids, params):
            _copy_state(self.state[p], sd["state"].get(i), name)
        if "host" in sd:
            self.load_host_state(sd["host"])
        for g, s in zip(self.param_groups, saved):
            g.update({k: v for k, v in s.items() if k not in _KEEP_ON_LOAD})

    @torch.no_grad()
    def load_host_state(self, host: dict) -> None:
        """Copy the host tables' row state in ({table name: state}, as state_dict's "host")."""
        for name, st in self.host_state.items():
            _copy_state(st, host.get(name), name)


def _placed_like(p: Tensor, flat: Tensor) -> Tensor:
    """`flat` (p's local element count) shaped as p's local part: a view, and for an FSDP2
    parameter a DTensor placed like it, so the checkpoint's gatherer sees a whole momentum."""
    if not hasattr(p, "placements"):
        return flat.view(p.shape)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        flat.view(p.to_local().shape),
        p.device_mesh,
        p.placements,
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )


def _copy_state(mine: dict, saved: dict | None, name: str) -> None:
    if saved is None or saved.keys() != mine.keys():
        raise ConfigError(
            f"optimizer state of {name}: saved {sorted(saved or {})}, this optimizer keeps "
            f"{sorted(mine)}; the checkpoint is from another optimizer (--set opt, optim_8bit) "
            f"or state dtype (int8 keeps codes and scales: resume with the checkpoint's "
            f"muon_state_dtype / engram_state_dtype)"
        )
    for k, t in mine.items():
        src = saved[k]
        if not torch.is_tensor(t):  # bitsandbytes counts its steps in a Python int
            mine[k] = src
        elif tuple(src.shape) != tuple(t.shape):
            raise ConfigError(
                f"optimizer state {k!r} of {name}: saved shape "
                f"{tuple(src.shape)}, this model needs {tuple(t.shape)}"
            )
        else:
            t.copy_(src)


def _first_difference(a: list[list[str]], b: list[list[str]]) -> str:
    fa = [n for grp in a for n in grp]
    fb = [n for grp in b for n in grp]
    for i, (x, y) in enumerate(zip(fa, fb)):
        if x != y:
            return f"parameter #{i}: this model has {x!r}, the state has {y!r}"
    if len(fa) != len(fb):
        return f"this model routes {len(fa)} parameters, the state {len(fb)}"
    return "the same parameters are grouped differently"
