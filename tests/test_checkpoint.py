"""Checkpoints: atomic writes, safe loads, loud shape mismatches, the format version, and the
state functions on a plain module, a DDP-wrapped one and an FSDP2 one (two gloo ranks); the
sharded format: atomic saves, its cleanup, the metadata pickle, resharding (2 -> 3 ranks and
1 process) and `dormouse export`."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
import torch

from dormouse.config import Optim, apply_sets, preset
from dormouse.model import DormouseModel
from dormouse.train.optim.mix import MixOptimizer
from dormouse.train.store import checkpoint as ckpt
from dormouse.train.store.folder import RunDir


def _save(tmp_path, run=None, **kw):
    run = run or preset("tiny")
    torch.manual_seed(0)
    model = DormouseModel(run.model)
    path = ckpt.save_checkpoint(tmp_path / "c.pt", run=run, model=model, step=3, **kw)
    return path, model


def test_round_trip_and_contents(tmp_path):
    path, model = _save(tmp_path, data_state={"kind": "stream", "step": 3})
    ck = ckpt.read_checkpoint(path)
    assert ck["step"] == 3 and ck["run"] == preset("tiny") and ck["data"]["step"] == 3
    assert ck["format"] == ckpt.FORMAT == 2
    fresh = DormouseModel(preset("tiny").model)
    ckpt.load_model(fresh, ck, path)
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n
    assert any("lfb_bias" in k for k in ck["model"])  # LFB buffers are in the file


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path, monkeypatch):
    path, _ = _save(tmp_path)
    before = path.read_bytes()

    def boom(*a, **k):  # a fault in the middle of the write
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(ckpt.CheckpointError, match="disk full.*previous checkpoint there is untou"):
        _save(tmp_path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp file left behind


def test_loads_with_weights_only(tmp_path, monkeypatch):
    path, _ = _save(tmp_path)
    seen = {}
    real = torch.load

    def spy(*a, **k):
        seen.update(k)
        return real(*a, **k)

    monkeypatch.setattr(torch, "load", spy)
    ckpt.read_checkpoint(path)
    assert seen.get("weights_only") is True


def test_a_pickle_with_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    bad = tmp_path / "evil.pt"
    torch.save({"config": "{}", "model": Evil()}, bad)
    with pytest.raises(ckpt.CheckpointError, match="could not be read") as e:
        ckpt.read_checkpoint(bad)
    # one line with torch's reason, never torch's advice to load it with weights_only=False
    msg = str(e.value)
    assert "\n" not in msg and "system" in msg and "never runs code" in msg, msg
    assert "weights_only" not in msg and "arbitrary code" not in msg, msg
    for i, body in enumerate(("garbage\n", "a text file named like a checkpoint\n")):
        text = tmp_path / f"notes{i}.pt"  # read as a pickle: opcode 'g' refused, 'a' fails
        text.write_text(body)
        with pytest.raises(ckpt.CheckpointError, match="could not be read") as e:
            ckpt.read_checkpoint(text)
        assert "\n" not in str(e.value) and "weights_only" not in str(e.value), str(e.value)


def test_shape_mismatch_names_the_fields(tmp_path):
    path, _ = _save(tmp_path)
    other = apply_sets(preset("tiny"), ["d_ffn=256", "n_experts=2", "moe_topk=1"])
    model = DormouseModel(other.model)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_model(model, ckpt.read_checkpoint(path), path)
    msg = str(e.value)
    assert "d_ffn: checkpoint 128 vs this run 256" in msg and "n_experts" in msg


@pytest.mark.parametrize("what", ["missing", "dir", "garbage"])
def test_bad_checkpoint_paths(tmp_path, what):
    p = tmp_path / "x.pt"
    if what == "dir":
        p.mkdir()
    elif what == "garbage":
        p.write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError):
        ckpt.read_checkpoint(p)


def test_a_truncated_checkpoint_is_refused(tmp_path):
    path, _ = _save(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ckpt.CheckpointError, match="may be truncated"):
        ckpt.read_checkpoint(path)


# ---- the state functions: format 1, a plain module, DDP, FSDP2 ------------------------------


def _step(net, opt, seed: int = 0) -> None:
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(seed))
    net(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    opt.zero_grad()


def _leaves(obj, path: str = "") -> dict:
    """{path: value} of every leaf of a nested state (a tuple and a list alike)."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _leaves(val, f"{path}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _leaves(val, f"{path}/{i}").items()}
    return {path: obj}


def _assert_same(a: dict, b: dict) -> None:
    """Every leaf equal: tensors bit for bit (plain ones, never a DTensor), the rest by value."""
    la, lb = _leaves(a), _leaves(b)
    assert la.keys() == lb.keys() and la
    for k, x in la.items():
        y = lb[k]
        if torch.is_tensor(x):
            assert type(x) is torch.Tensor and type(y) is torch.Tensor, k
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k
        else:
            assert x == y, k


def _snapshot(net, opt) -> dict:
    blob = io.BytesIO()  # what a file holds: the live tensors of a CPU run, frozen
    torch.save({"model": ckpt.model_state(net), "optimizer": ckpt.optimizer_state(net, opt)}, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)


def test_a_format_1_optimizer_state_is_refused_and_its_model_still_loads(tmp_path):
    path, _model = _save(tmp_path)
    ck = ckpt.read_checkpoint(path)
    ck["format"] = 1  # the model state of format 1 is format 2's
    fresh = DormouseModel(preset("tiny").model)
    ckpt.load_model(fresh, ck, path)
    old = {"format": "dormouse.MixOptimizer/2", "opt": "mix", "muon": [], "adamw": None}
    with pytest.raises(ckpt.CheckpointError, match="format 1.*format 2 only.*--overwrite"):
        ckpt.load_optimizer_state(
            fresh, MixOptimizer(fresh, Optim(wd=0.0, ns_dtype="fp32", lr=1e-3)), old, path
        )


def test_a_state_with_other_keys_is_refused(tiny_model):
    model = tiny_model()
    state = ckpt.model_state(model)
    del state["head.weight"]
    state["head.bias"] = torch.zeros(1)
    with pytest.raises(ckpt.CheckpointError, match=r"missing \['head.weight'\], unexpected "
                                                    r"\['head.bias'\]"):  # fmt: skip
        ckpt.load_model_state(tiny_model(), state)


@pytest.mark.parametrize("state", ["fp32", "int8"])
@pytest.mark.parametrize("ram", [False, True])
def test_one_process_round_trip_needs_no_process_group(ram, state, tiny_model):
    import torch.distributed as dist

    assert not dist.is_initialized()
    kw = dict(lr=0.01, wd=0.0, ns_dtype="fp32", opt="mix", muon_state_dtype=state,
              engram_state_dtype=state)  # fmt: skip
    model = tiny_model(engram_ram=ram)
    opt = MixOptimizer(model, Optim(**kw))
    _step(model, opt)
    saved = _snapshot(model, opt)
    fresh = tiny_model(1, engram_ram=ram)
    opt2 = MixOptimizer(fresh, Optim(**kw))
    ckpt.load_model_state(fresh, saved["model"])
    ckpt.load_optimizer_state(fresh, opt2, saved["optimizer"])
    _assert_same(_snapshot(fresh, opt2), saved)
    _step(model, opt, seed=1)
    _step(fresh, opt2, seed=1)
    _assert_same(_snapshot(fresh, opt2), _snapshot(model, opt))


def test_ddp_wrapped_model_uses_the_same_functions_and_names(one_rank_group, tiny_model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tiny_model(engram_ram=True)
    net = DDP(model)
    opt = MixOptimizer(net, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="mix"))
    _step(net, opt)
    saved = _snapshot(net, opt)
    assert saved["model"].keys() == model.state_dict().keys()  # no `module.` prefix
    assert (
        "engram.store.table" in saved["model"]
        and "engram.store.table" in saved["optimizer"]["state"]
    )
    fresh = tiny_model(1, engram_ram=True)
    net2 = DDP(fresh)
    opt2 = MixOptimizer(net2, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="mix"))
    ckpt.load_model_state(net2, saved["model"])
    ckpt.load_optimizer_state(net2, opt2, saved["optimizer"])
    _assert_same(_snapshot(net2, opt2), saved)
    # and into one plain process
    plain = tiny_model(2, engram_ram=True)
    opt3 = MixOptimizer(plain, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="mix"))
    ckpt.load_model_state(plain, saved["model"])
    ckpt.load_optimizer_state(plain, opt3, saved["optimizer"])
    _assert_same(_snapshot(plain, opt3), saved)


def _fleet_work(work) -> None:
    """Run a gloo rank's `work`, then tear the fleet down while the interpreter is whole.

    FSDP's modules hold the process group and sit in reference cycles, so the group's last
    reference would otherwise go only at interpreter exit, where gloo's threads can abort the
    rank ("terminate called without an active exception": seen once under xdist load, rank 1
    SIGABRT after its work was done). The work's locals go when it returns; gc collects the
    cycles; the barrier keeps a rank from closing its pairs while a peer still uses them.
    """
    import gc

    import torch.distributed as dist

    try:
        work()
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()


def _fsdp_rank(rank: int, tmp: str, tiny_model) -> None:
    """One rank of a 2-rank gloo fleet: FSDP2 (per block, then the root, as the trainer wraps),
    AdamW (FSDP2 runs no Muon), one step on this rank's bytes; rank 0 saves the full state;
    then a fresh fleet loads that file on every rank and rank 0 saves what it gathers again."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 2), rank=rank,
                            world_size=2)  # fmt: skip

    def work() -> None:
        mesh = init_device_mesh("cpu", (2,))  # a CPU mesh on a machine with cards too
        for ram in (False, True):

            def build(seed):
                model = tiny_model(seed, engram_ram=ram)
                for block in model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                return model, MixOptimizer(
                    model, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="adamw")
                )

            model, opt = build(0)
            _step(model, opt, seed=rank)
            full = {"model": ckpt.model_state(model), "optimizer": ckpt.optimizer_state(model, opt)}
            if rank == 0:
                torch.save(full, f"{tmp}/full-{ram}.pt")
            else:
                assert full == {"model": {}, "optimizer": {}}, "the full state is rank 0's"
            dist.barrier()
            model, opt = build(1)
            saved = torch.load(f"{tmp}/full-{ram}.pt", weights_only=True)
            ckpt.load_model_state(model, saved["model"])
            ckpt.load_optimizer_state(model, opt, saved["optimizer"])
            again = {
                "model": ckpt.model_state(model),
                "optimizer": ckpt.optimizer_state(model, opt),
            }
            if rank == 0:
                torch.save(again, f"{tmp}/again-{ram}.pt")
            dist.barrier()

    _fleet_work(work)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_fsdp2_full_state_loads_into_one_process(tmp_path, tiny_model):
    import torch.multiprocessing as mp

    mp.start_processes(_fsdp_rank, args=(str(tmp_path), tiny_model), nprocs=2,
                       start_method="spawn")  # fmt: skip
    for ram in (False, True):
        full = torch.load(tmp_path / f"full-{ram}.pt", weights_only=True)
        # the fleet reloads its own file: what it gathers again is the file
        _assert_same(torch.load(tmp_path / f"again-{ram}.pt", weights_only=True), full)
        model = tiny_model(2, engram_ram=ram)
        opt = MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="adamw"))
        ckpt.load_model_state(model, full["model"])
        ckpt.load_optimizer_state(model, opt, full["optimizer"])
        _assert_same(_snapshot(model, opt), full)
        moved = full["optimizer"]["state"]["engram.store.table"]["step"]
        assert moved.any() and not moved.all()  # the row state was gathered, not made afresh


# ---- the sharded format (FSDP2): atomic, safe, resharding, export -------------------------


def _sharded(tmp_path, model, opt=None, step=1):
    """A sharded checkpoint written by one process (no process group): the same writer."""
    opt = (
        opt
        if opt is not None
        else MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="adamw"))
    )
    path = tmp_path / "ckpt.pt"
    ckpt.save_sharded(
        path,
        model,
        opt,
        run=preset("tiny"),
        step=step,
        data_state={"kind": "stream", "step": step},
        data_fingerprint=None,
    )
    return path, model, opt


def test_sharded_round_trip_in_one_process(tmp_path, tiny_model):
    model = tiny_model()
    opt = MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="adamw"))
    _step(model, opt)
    path, *_ = _sharded(tmp_path, model, opt, step=1)
    _step(model, opt, seed=1)
    saved = _snapshot(model, opt)
    _sharded(tmp_path, model, opt, step=2)
    ck = ckpt.read_checkpoint(path)
    assert ck["format"] == ckpt.SHARDED_FORMAT and ck["step"] == 2 and "model" not in ck
    assert ck["data"] == {"kind": "stream", "step": 2} and len(ck["rng"]) == ck["world"] == 1
    # the step-1 directory went with the commit of step 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt.pt", ck["shards"]])
    fresh = tiny_model(1)
    opt2 = MixOptimizer(fresh, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="adamw"))
    ckpt.load_train_state(fresh, opt2, ck, path, fresh.cfg)
    _assert_same(_snapshot(fresh, opt2), saved)


def test_a_failed_sharded_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, tiny_model):
    from torch.distributed.checkpoint import FileSystemWriter

    path, model, opt = _sharded(tmp_path, tiny_model())
    before = {p.name for p in tmp_path.iterdir()}
    real = FileSystemWriter.write_data

    def full(self, plan, planner):  # a rank's shard file half written, then the disk is full
        real(self, plan, planner).wait()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(ckpt.CheckpointError, match="previous checkpoint there is untouched"):
        _sharded(tmp_path, model, opt, step=2)
    assert {p.name for p in tmp_path.iterdir()} == before  # no temp directory left
    monkeypatch.undo()
    # a commit that fails after the rename (the manifest cannot be written) rolls it back
    monkeypatch.setattr(ckpt, "_write_file", lambda *a: (_ for _ in ()).throw(OSError(5, "EIO")))
    with pytest.raises(ckpt.CheckpointError, match="EIO|Input/output"):
        _sharded(tmp_path, model, opt, step=2)
    monkeypatch.undo()
    assert {p.name for p in tmp_path.iterdir()} == before

    def elsewhere(self, plan, planner):  # the shard file lands where rank 0 cannot see it
        fut = real(self, plan, planner)
        fut.wait()
        for f in Path(self.path).glob("*.distcp"):
            f.unlink()
        return fut

    monkeypatch.setattr(FileSystemWriter, "write_data", elsewhere)
    with pytest.raises(ckpt.CheckpointError, match="missing from .*filesystem every rank sees"):
        _sharded(tmp_path, model, opt, step=2)
    monkeypatch.undo()
    assert {p.name for p in tmp_path.iterdir()} == before
    ck = ckpt.read_checkpoint(path)
    assert ck["step"] == 1
    ckpt.load_model(tiny_model(3), ck, path)


def test_what_a_killed_sharded_save_leaves_is_cleaned_at_start(tmp_path, tiny_model):
    import shutil

    path, *_ = _sharded(tmp_path, tiny_model())
    live = ckpt.read_checkpoint(path)["shards"]
    orphan = tmp_path / "ckpt.000002.x1.shards"  # renamed, never committed (killed between)
    shutil.copytree(tmp_path / live, orphan)
    dead = tmp_path / ".ckpt.pt.999999999.abc.tmp"  # a dead writer's staging directory
    (dead / "sub").mkdir(parents=True)
    mine = tmp_path / f".ckpt.pt.{os.getppid()}.abc.tmp"  # a live writer's (our parent)
    mine.mkdir()
    removed = RunDir(tmp_path).clean_stale_temps()
    assert sorted(removed) == [dead.name, orphan.name]
    assert (tmp_path / live).is_dir() and mine.is_dir()
    # a single file that replaced a sharded checkpoint drops its directory
    ckpt.save_checkpoint(path, run=preset("tiny"), model=tiny_model(), step=3)
    assert not (tmp_path / live).exists()


def test_sharded_metadata_with_code_is_refused(tmp_path, tiny_model):
    """DCP's .metadata is a pickle: ours is read by an unpickler that builds DCP's records only."""
    import pickle

    path, *_ = _sharded(tmp_path, tiny_model())
    ck = ckpt.read_checkpoint(path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ck["shards_dir"] / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ckpt.CheckpointError, match="could not be read as DCP metadata.*no code"):
        ckpt.load_model(tiny_model(), ck, path)
    with pytest.raises(ckpt.CheckpointError, match="no code"):
        ckpt.export_checkpoint(path, tmp_path / "x.pt")
    assert not marker.exists()


def test_a_non_tensor_entry_in_the_shards_is_refused(tmp_path, tiny_model):
    """DCP unpickles a non-tensor entry with weights_only=False; a sharded checkpoint holds none."""
    import torch.distributed.checkpoint as dcp

    path, model, opt = _sharded(tmp_path, tiny_model())
    ck = ckpt.read_checkpoint(path)
    mstate, ostate = ckpt._sharded_targets(model, opt)
    mstate["head.weight"] = "a string, pickled"
    with pytest.warns(UserWarning):  # DCP: no process group
        dcp.save({"model": mstate, "optimizer": ostate["state"]}, checkpoint_id=ck["shards_dir"],
                 no_dist=True)  # fmt: skip
    with pytest.raises(ckpt.CheckpointError, match="'model.head.weight' is no tensor"):
        ckpt.load_model(tiny_model(), ck, path)  # the whole state, built from the metadata
    fresh = tiny_model()
    opt = MixOptimizer(fresh, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="adamw"))
    with pytest.raises(ckpt.CheckpointError, match="non-tensor entry 'model.head.weight'"):
        ckpt.load_train_state(fresh, opt, ck, path, fresh.cfg)


def test_a_sharded_checkpoint_without_its_directory_is_refused(tmp_path, tiny_model):
    import shutil

    path, *_ = _sharded(tmp_path, tiny_model())
    elsewhere = tmp_path / "copy"
    elsewhere.mkdir()
    shutil.copy(path, elsewhere / "ckpt.pt")  # the manifest copied without its directory
    with pytest.raises(ckpt.CheckpointError, match="not beside it.*copy the whole run folder"):
        ckpt.read_checkpoint(elsewhere / "ckpt.pt")


def test_export_writes_one_file_that_loads_anywhere(tmp_path, tiny_model):
    from dormouse.cli import main

    path, model, opt = _sharded(tmp_path, tiny_model(), step=4)
    assert main(["export", str(tmp_path), "--to", str(tmp_path / "model.pt")]) == 0
    one = ckpt.read_checkpoint(tmp_path / "model.pt")  # weights_only=True
    assert one["format"] == ckpt.FORMAT and one["step"] == 4
    _assert_same({"model": one["model"], "optimizer": one["optimizer"]},
                 _snapshot(model, opt))  # fmt: skip
    assert main(["export", str(path), "--to", str(tmp_path)]) == 2  # a folder is no file


def test_export_to_a_path_under_a_file_names_to(tmp_path):
    """The refusal came from the run folder's writer: `cannot create the run folder ...; pick
    a writable --out`, a flag export does not have."""
    path, _ = _save(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for dest in (afile / "model.pt", afile / "sub" / "model.pt"):
        with pytest.raises(
            ckpt.CheckpointError,
            match=re.escape(
                f"--to {dest}: {afile} is a file, not a folder; name a file in a folder"
            ),
        ):
            ckpt.export_checkpoint(path, dest)
    assert afile.read_text() == "x"


def _sharded_fleet_rank(rank: int, world: int, tmp: str, mode: str, tiny_model) -> None:
    """FSDP2 on `world` gloo ranks, per block and root as the trainer wraps; AdamW, and the
    default optimizer (Muon) with the host-RAM tables. save: two steps, a sharded save after
    each; load: a fresh fleet (another seed) loads it. Rank 0 saves the gathered full state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store-{mode}{world}", world),
                            rank=rank, world_size=world)  # fmt: skip

    def work() -> None:
        mesh = init_device_mesh("cpu", (world,))
        for kind, ram in (("adamw", False), ("mix", True)):
            model = tiny_model(0 if mode == "save" else 5, engram_ram=ram)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt=kind))
            path = f"{tmp}/run-{kind}/ckpt.pt"
            if mode == "save":
                for s in (1, 2):
                    # the same bytes on every rank: nothing here reduces the host rows' gradient
                    # (the trainer's context does), and their tables must stay replicas
                    _step(model, opt, seed=s)
                    ckpt.save_state(path, model, opt, run=preset("tiny"), step=s,
                                    data_state={"kind": "stream", "step": s},
                                    data_fingerprint=None, main=rank == 0)  # fmt: skip
            else:
                ck = ckpt.read_checkpoint(path)
                ckpt.load_train_state(model, opt, ck, path, model.cfg)
            full = {"model": ckpt.model_state(model), "optimizer": ckpt.optimizer_state(model, opt)}
            if rank == 0:
                torch.save(full, f"{tmp}/{kind}-{mode}{world}.pt")
            dist.barrier()

    _fleet_work(work)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_a_2_rank_sharded_checkpoint_reshards_to_3_ranks_and_to_one_process(tmp_path, tiny_model):
    import torch.multiprocessing as mp

    mp.start_processes(_sharded_fleet_rank, args=(2, str(tmp_path), "save", tiny_model),
                       nprocs=2, start_method="spawn")  # fmt: skip
    mp.start_processes(_sharded_fleet_rank, args=(3, str(tmp_path), "load", tiny_model),
                       nprocs=3, start_method="spawn")  # fmt: skip
    for kind, ram in (("adamw", False), ("mix", True)):
        full = torch.load(tmp_path / f"{kind}-save2.pt", weights_only=True)
        path = tmp_path / f"run-{kind}" / "ckpt.pt"
        ck = ckpt.read_checkpoint(path)
        assert ck["world"] == 2 and len(list(path.parent.glob("*.shards"))) == 1
        _assert_same(torch.load(tmp_path / f"{kind}-load3.pt", weights_only=True), full)
        model = tiny_model(7, engram_ram=ram)
        opt = MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt=kind))
        ckpt.load_train_state(model, opt, ck, path, model.cfg)
        _assert_same(_snapshot(model, opt), full)
        ckpt.export_checkpoint(path, tmp_path / f"{kind}.pt")
        one = ckpt.read_checkpoint(tmp_path / f"{kind}.pt")
        _assert_same({"model": one["model"], "optimizer": one["optimizer"]}, full)
