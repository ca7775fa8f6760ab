"""The step's verdict kept on the device (TrainConfig.verdict, issue 16 item 1: "no host
synchronisation inside the step except the one agreed finiteness decision, asynchronous if it
can be"): the optimizer step and the LFB update take the verdict as a device tensor and leave
no trace of a skipped step; the loop reads each verdict a step late. On the CPU the same code
runs with the optimizer's device-side arithmetic eagerly (verdict=device); the reference is
the same arithmetic decided on the host, so any difference is the deferral's own.
"""

from __future__ import annotations

import pytest
import torch
from trainlog import train

from dormouse.config import ConfigError, Optim, apply_sets, preset, validate
from dormouse.model import DormouseModel
from dormouse.train.optim.mix import MixOptimizer
from references.fingerprint import fingerprint


def _state(model, opt) -> list[torch.Tensor]:
    """Every parameter, buffer and optimizer-state tensor, cloned (state_dict's order)."""
    out = [t.detach().clone() for t in model.state_dict().values()]

    def walk(x):
        if torch.is_tensor(x):
            out.append(x.detach().clone())
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(opt.state_dict())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _grads(model, x, poison: bool) -> None:
    model.zero_grad(set_to_none=True)
    _, loss, _ = model(x[:, :-1], x[:, 1:])
    loss.backward()
    if poison:  # one non-finite entry per gradient, as an overflow leaves it
        for p in model.parameters():
            if p.grad is not None:
                p.grad.view(-1)[0] = float("nan")


@pytest.mark.parametrize("muon_state_dtype", ["fp32", "bf16"])
def test_a_step_refused_on_the_device_writes_nothing(muon_state_dtype, tiny_model):
    """Every tensor the step writes is put back when the device verdict is False: the
    parameters, Muon's stacked momentum, AdamW's moments and step counters, the Engram rows'
    moments and step counts (a tensor missing from MixOptimizer.written() shows here). When it
    is True, the step is the one decided on the host, bit for bit."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (2, 33), generator=g) for _ in range(4)]
    models, opts = [], []
    for _ in range(2):
        m = tiny_model(kda_impl="torch")
        o = MixOptimizer(
            m, Optim(lr=0.02, wd=0.1, ns_dtype="fp32", muon_state_dtype=muon_state_dtype)
        )
        assert o.capture_step(capture=False) == ""
        models.append(m)
        opts.append(o)
    (dev, opt), (host, ref) = zip(models, opts)
    assert opt.commit_on_device() == ""
    assert opt.written_bytes() > sum(p.numel() * 4 for p in dev.parameters())  # + the state
    for i, x in enumerate(xs):
        _grads(dev, x, poison=i == 2)
        before = _state(dev, opt)
        opt.step(commit=torch.tensor(i != 2))
        if i == 2:
            assert _same(_state(dev, opt), before), "a refused step left a trace"
            continue
        assert not _same(_state(dev, opt), before)
        _grads(host, x, poison=False)
        ref.step()
        assert _same(_state(dev, opt), _state(host, ref))


def _run(tmp_path, corpus, name, *sets):
    return apply_sets(preset("tiny"), [
        f"data={corpus}", f"out_dir={tmp_path / name}", "steps=14", "batch=2",
        "seq_len=32", "moe_lb_coef=0.01", "log_every=3", "eval_every=5", "ckpt_every=6",
        "val_bytes=4096", "eval_batches=2", "kda_impl=torch", *sets])  # fmt: skip


class _InfGrad(torch.autograd.Function):
    """The loss unchanged, its gradient infinite: a finite loss with an overflowing backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def _poisoned(model, nan_at=(3,), inf_grad_at=(5, 6)):
    """The model's forward, non-finite at the given training forwards (1-based; evaluation
    forwards are not counted): a NaN loss, or a finite loss whose gradient is infinite (the
    norm's half of the verdict)."""
    real = model.forward
    calls = [0]

    def forward(x, y=None, **kw):
        logits, loss, aux = real(x, y, **kw)
        if model.training:
            calls[0] += 1
            if calls[0] in nan_at:
                loss = loss * float("nan")
            elif calls[0] in inf_grad_at:
                loss = _InfGrad.apply(loss)
        return logits, loss, aux

    model.forward = forward
    return model


def _device_side_optimizer(monkeypatch):
    """verdict=host runs with the optimizer's device-side arithmetic too (the reference)."""
    made = MixOptimizer.from_config.__func__

    def from_config(cls, model, train_cfg, device_type):
        opt = made(cls, model, train_cfg, device_type)
        if train_cfg.verdict == "host":
            assert opt.capture_step(capture=False) == ""
        return opt

    monkeypatch.setattr(MixOptimizer, "from_config", classmethod(from_config))


def test_the_loop_reading_verdicts_a_step_late_trains_as_the_host_verdict(
    tmp_path, corpus, monkeypatch, tiny_model
):
    """14 steps, a NaN loss at step 2 and an infinite gradient at steps 4 and 5 (0-based,
    whose ends are an evaluation, at 5, and a checkpoint, at 6: skipped steps that both keep),
    logs every 3: the same parameters, LFB buffers, checkpoint, metrics rows and skip lines as
    the host's verdict."""
    _device_side_optimizer(monkeypatch)
    out = {}
    for verdict in ("host", "device"):
        run = _run(tmp_path, corpus, verdict, f"verdict={verdict}")
        lines = []
        model = _poisoned(tiny_model(cfg=run.model))
        rep = train(model, run, log=lines.append)
        rows = (tmp_path / verdict / "metrics.jsonl").read_text().splitlines()
        out[verdict] = (model, rep, lines, rows)
    (host, rh, lh, mh), (dev, rd, ld, md) = out["host"], out["device"]
    assert any("verdict=device: on the device" in ln for ln in ld)
    assert rh["skips"] == rd["skips"] == 3
    assert fingerprint(dev) == fingerprint(host)
    for a, b in zip(dev.buffers(), host.buffers(), strict=True):  # the LFB biases among them
        assert torch.equal(a, b)
    skipped = [ln for ln in lh if "skipped" in ln]
    assert skipped == [ln for ln in ld if "skipped" in ln] and len(skipped) == 3

    def strip(row: str) -> dict:  # timings differ run to run
        import json

        r = json.loads(row)
        return {k: v for k, v in r.items() if k not in ("tok_s", "ms", "train_s")}

    assert [strip(r) for r in md] == [strip(r) for r in mh]
    assert rh["loss"] == rd["loss"] and rh["tokens"] == rd["tokens"]


def test_verdict_device_is_refused_where_it_cannot_hold(tmp_path, corpus, tiny_model):
    run = _run(tmp_path, corpus, "fleet", "verdict=device", "dist=true", "dist_shard=fsdp")
    with pytest.raises(ConfigError, match="FSDP2's shards step through collectives"):
        validate(run)
    validate(_run(tmp_path, corpus, "ddp", "verdict=device", "dist=true"))  # DDP: gate g05
    ram = _run(tmp_path, corpus, "ram", "verdict=device", "engram_ram=true")
    with pytest.raises(ConfigError, match="verdict=device: host-RAM Engram tables"):
        train(DormouseModel(ram.model), ram)
    from dormouse.train.context import DPContext
    from dormouse.train.optim.scaler import LossScaler
    from dormouse.train.step import device_verdict

    one = _run(tmp_path, corpus, "fp16", "verdict=device").train
    opt = MixOptimizer(tiny_model(kda_impl="torch"), Optim(wd=0.0, ns_dtype="fp32", lr=0.01))
    ctx = DPContext.single(torch.device("cpu"), one.batch, one.seq_len)
    with pytest.raises(ConfigError, match="verdict=device: the fp16 loss scale"):
        device_verdict(one, ctx, opt, LossScaler(one.loss_scale_every))
    int8 = MixOptimizer(
        tiny_model(kda_impl="torch"),
        Optim(wd=0.0, ns_dtype="fp32", lr=0.01, muon_state_dtype="int8"),
    )
    with pytest.raises(ConfigError, match="verdict=device: muon_state_dtype=int8"):
        device_verdict(one, ctx, int8, None)
    lines = []
    # the CPU: no optimizer graph, decided on the host
    auto = _run(tmp_path, corpus, "auto", "steps=2")
    train(tiny_model(cfg=auto.model), auto, log=lines.append)
    assert any("verdict=auto: on the host (the optimizer steps on the host" in ln for ln in lines)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_captured_step_takes_the_verdict_on_the_device(tiny_model):
    """On a CUDA device: the optimizer graph captured with the copy aside replays a refused
    step as no step at all and a taken step as the graph without it does, bit for bit."""
    from dormouse.train.optim.mix import GRAPH_WARMUP

    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (2, 33), generator=g).cuda() for _ in range(GRAPH_WARMUP + 5)]
    pair = []
    for transact in (True, False):
        m = tiny_model(kda_impl="torch").cuda()
        o = MixOptimizer(m, Optim(lr=0.02, wd=0.1, ns_dtype="fp32"))
        assert o.capture_step(keep="always") == ""
        assert (o.commit_on_device() == "") if transact else True
        pair.append((m, o))
    (dev, opt), (ref, plain) = pair
    refused = GRAPH_WARMUP + 2  # after the capture: a replay
    for i, x in enumerate(xs):
        _grads(dev, x, poison=i == refused)
        before = _state(dev, opt)
        opt.step(commit=torch.tensor(i != refused, device="cuda"))
        if i == refused:
            assert opt._graph.graph is not None
            assert _same(_state(dev, opt), before), "a refused replay left a trace"
            continue
        _grads(ref, x, poison=False)
        plain.step()
        assert _same(_state(dev, opt), _state(ref, plain)), i
