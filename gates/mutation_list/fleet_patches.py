"""The patch functions of the fleet-scope mutations (gates/mutation_list/fleet.py): each
takes the original and returns the broken version a fleet rank runs."""

from __future__ import annotations

import os

from gates.mutation_list.common import this_rank


def _never_last_micro_batch(orig):
    """parallelize whose no_sync hook treats every micro-batch as a non-final one."""
    import dataclasses

    def parallelize(model, ctx):
        w = orig(model, ctx)
        return dataclasses.replace(w, no_sync=lambda last: w.no_sync(False))

    return parallelize


def _own_verdict(orig):
    def all_finite(self, finite):
        orig(self, finite)  # every rank still takes part in the collective...
        return finite  # ...and then goes by its own verdict

    return all_finite


def _own_verdict_off_rank0(orig):
    def all_finite(self, finite):
        agreed = orig(self, finite)
        return agreed if self.rank == 0 else finite

    return all_finite


def _own_device_verdict(orig):
    def all_finite_on_device(self, ok):
        orig(self, ok)  # the all-reduce still runs on every rank...
        return ok  # ...and each goes by its own verdict

    return all_finite_on_device


def _transaction_without_restore(orig):
    def _transacted(self, body):
        body()  # the step runs; nothing is copied aside or put back

    return _transacted


def _zg_step(orig):
    return lambda self, *a, **kw: (setattr(self, "_mut_stepped", True), orig(self, *a, **kw))[1]


def _zg_zero(orig):
    def zero_grad(self, set_to_none=True):
        if getattr(self, "_mut_stepped", False):
            self._mut_stepped = False
            orig(self, set_to_none)

    return zero_grad


def _hook_without_division(orig):
    def compress(dtype):
        mean = orig(dtype)

        def hook(state, bucket):
            import torch.distributed as dist

            bucket.buffer().mul_(dist.get_world_size())  # the bug: the hook's division undone
            return mean(state, bucket)

        return hook

    return compress


def _merge_in_rank_order_of(orig):
    def merge(parts, world_size):
        r = this_rank() % max(1, len(parts))
        return orig(list(parts[r:]) + list(parts[:r]), world_size)  # each rank starts with its own

    return merge


def _unweighted_fleet_loss(_orig):
    def fleet_loss(self, loss):
        import torch
        import torch.distributed as dist

        x = loss.detach().to(device=self.device, dtype=torch.float64).reshape(1)
        dist.all_reduce(x)
        return float(x.item()) / self.world

    return fleet_loss


def _clip_over_parameters(_orig):
    def clip_grad_norm_(self, max_norm):
        import torch

        owners = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in owners], 2.0)
        if hasattr(total, "full_tensor"):  # FSDP2: a plain tensor, as the real clip returns
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(owners, max_norm, total)
        return total

    return clip_grad_norm_


def _fp32_reduce_in_bf16(orig):
    import torch

    return {**orig, "fp32": torch.bfloat16}


def _save_step_plus_one(orig):
    def save(path, *, step, **kw):
        return orig(path, step=step + 1, **kw)

    return save


def _shards_in_place(orig):
    def staging(path):
        import shutil

        import torch

        tmp = orig(path)  # every rank still learns a temporary name...
        ck = torch.load(path, weights_only=True) if path.is_file() else {}
        if not ck.get("shards"):
            return tmp
        shutil.rmtree(tmp, ignore_errors=True)
        return path.parent / ck["shards"]  # ...and writes into the live checkpoint's directory

    return staging


def _own_staging_dir(orig):
    def staging(path):
        import tempfile
        from pathlib import Path

        tmp = orig(path)
        if this_rank() == 0:
            return tmp
        return Path(
            tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
        )  # each rank its own directory

    return staging


def _polar_of_own_rows(_orig):
    # each rank orthogonalises the rows it holds (its shard, zeros elsewhere: polar([A; 0]) is
    # [polar(A); 0]) instead of the whole matrix; no collective
    def whole(params, U, sizes, R, C):
        import torch

        from dormouse.train.optim.muon import shard_rows

        out = []
        for p, u in zip(params, U.split(sizes)):
            _, first, n = shard_rows(p)
            row = p.numel() // p.shape[0]
            full = u.new_zeros(p.numel())
            full[first * row : (first + n) * row] = u
            out.append(full.view(-1, R, C))
        return torch.cat(out)

    return whole


def _rows_from_zero(orig):
    def shard_rows(p):
        chunk, _first, rows = orig(p)
        return chunk, 0, rows

    return shard_rows


def _switch_keeps_stream(orig):
    def switch(self, split):
        inner = self.inner
        orig(self, split)
        self.inner = inner

    return switch


def _switch_keeps_context(orig):
    def switch(self, split):
        ctx = self.ctx
        orig(self, split)
        self.ctx = ctx

    return switch


def _keys_by_local_row(orig):
    import torch

    from dormouse.model.layers import row_keys

    def dropout_keys(model, ctx, seed, step, rows):
        if orig(model, ctx, seed, step, rows) is None:
            return None
        return row_keys(seed, step, torch.arange(rows))  # each rank numbers its rows from 0

    return dropout_keys


def _phase_per_rank(orig):
    def phase(self, n_pass):
        return (orig(self, n_pass) + self.offset) % self.view.shape[0]  # each rank its own

    return phase


def _scale_on_fp16_ranks_only(_orig):
    import torch

    return lambda autocast, ctx: autocast == torch.float16  # the fleet's dtypes unread


def _unscale_off_rank1(orig):
    def unscale_(self, inverse):
        if this_rank() != 1:  # rank 1 is the gate's fp16 rank
            orig(self, inverse)

    return unscale_


def _eval_own_share(_orig):
    def evaluate_fleet(model, batches, ctx, autocast_dtype):
        from dormouse.train import step

        # each rank scores batches r::world and keeps its own mean: the sums never meet
        return step.evaluate(model, batches[ctx.rank :: ctx.world], ctx.device, autocast_dtype)

    return evaluate_fleet
