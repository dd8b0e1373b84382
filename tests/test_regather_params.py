"""Parameters gathered again in the backward (``StepConfig(reshard_after_forward=True)``,
``passes/regather_params.py``).

On 2 gloo ranks, a model whose parameters are sharded and all-gathered inside the step (one
cast to bf16 before its gather, as a mixed-precision policy does; one gathered weight read
twice) and whose input is gathered over the ranks' features (an activation gather, as sequence
parallelism makes) runs a Retain rollout and update through ``lean_compile``, with and without
the re-gather, under both compilers, and with the block that reads a weight a second time
inside ``torch.utils.checkpoint`` (aot_eager), and SimpleFSDP-like (aot_eager): the checkpointed
block gathers the weight itself again, as a parametrization that gathers on every access does,
and a gathered weight is scaled by a buffer. Against eager autograd on the same shards: the
gradients; against the step without the re-gather: bitwise. What the graphs show: the forward
saves no gathered weight (what a call keeps falls by the gathered bytes), the backward gathers
the parameters again, the activation's gather is left alone with its reason.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

from compat import all_gather_single
from models import gather_shard, register_shards
from ranks import spawn


class ShardedMLP(torch.nn.Module):
    """Parts of ``w1``, ``b1``, ``w2`` (``Shard(0)`` rows, padded), gathered in the forward."""

    def __init__(self, rank, world, d=8, h=12, checkpoint=False, simple_fsdp=False):
        super().__init__()
        self.checkpoint = checkpoint
        # SimpleFSDP-like: the checkpointed block gathers w1 itself (a parametrization gathers
        # on every access), and w2 is scaled by a buffer (a weight mixed with a tensor that
        # is not gathered)
        self.simple_fsdp = simple_fsdp
        self.register_buffer("scale", torch.linspace(-0.5, 0.5, 5))
        torch.manual_seed(0)
        self.rows = register_shards(self, {"w1": torch.randn(h, d * world) / d,
                                           "b1": torch.randn(h),
                                           "w2": torch.randn(5, h) / h ** 0.5}, rank, world)

    def full(self, name):
        return gather_shard(getattr(self, name), self.rows[name],
                            torch.bfloat16 if name == "w2" else None)

    def forward(self, x):
        x = all_gather_single(x, 1, dist.group.WORLD)  # the ranks' features, [B, d * R]
        w1 = self.full("w1")
        h = torch.tanh(x @ w1.T + self.full("b1"))
        if self.simple_fsdp:
            h = torch.utils.checkpoint.checkpoint(
                lambda h: self.block(h, self.full("w1")), h, use_reentrant=False)
            w2 = self.full("w2") * self.scale.exp()[:, None].bfloat16()
        elif self.checkpoint:  # activation checkpointing around a block reading w1 again
            h = torch.utils.checkpoint.checkpoint(self.block, h, w1, use_reentrant=False)
            w2 = self.full("w2")
        else:
            h = self.block(h, w1)
            w2 = self.full("w2")
        return (h.bfloat16() @ w2.T).float()

    @staticmethod
    def block(h, w1):
        return h + 0.1 * torch.tanh(h @ w1[:, :h.shape[1]])  # w1 read a second time


def _loop(model, fn, xs):
    """A rollout over ``xs`` (every call trained), then the update on the same inputs."""
    rollout = getattr(fn, "rollout", None)
    with (rollout(train=len(xs)) if rollout else torch.no_grad()), torch.no_grad():
        for x in xs:
            fn(x)
    update = getattr(fn, "update", None)
    model.zero_grad(set_to_none=True)
    with (update() if update else torch.enable_grad()):
        for x in xs:
            fn(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _worker(rank, world, init, out, compilers):
    import leancompile

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    xs = [torch.randn(3, 8) for _ in range(2)]
    eager = ShardedMLP(rank, world)
    grads = {"eager": _loop(eager, eager, xs)}
    graphs = {}
    variants = [(c, "", r) for c in compilers for r in (False, True)] + \
        [("aot_eager", kind, r) for kind in ("checkpoint", "simple_fsdp") for r in (False, True)]
    references = {"": grads["eager"]}
    for kind in ("checkpoint", "simple_fsdp"):
        eager = ShardedMLP(rank, world, **{kind: True})
        references[kind] = _loop(eager, eager, xs)
    for compiler, kind, regather in variants:
        torch._dynamo.reset()
        model = ShardedMLP(rank, world, **({kind: True} if kind else {}))
        step = leancompile.lean_compile(model, backend=compiler, schedule="retain",
                                        reshard_after_forward=regather)
        name = f"{compiler}{'+' + kind if kind else ''}/{regather}"
        grads[name] = _loop(model, step, xs)
        assert step.stats.reused_calls == step.stats.update_calls == len(xs), \
            step.stats.summary()
        (graph,) = step.graphs
        found = graph.regather
        graphs[name] = {
            "kept": graph.kept_bytes(3),
            "backward_gathers": sum("all_gather_into_tensor" in str(n.target)
                                    for n in graph.backward_aten.graph.nodes),
            "sites": None if found is None else [s.parameter for s in found.sites],
            "saved": None if found is None else found.saved,
            "gathered_bytes": None if found is None else found.gathered_bytes,
            "skipped": None if found is None else [r for _, r in found.skipped]}

    def vs_reference(name):
        kind = name.split("/")[0].partition("+")[2]
        return max(float((x - y).norm() / y.norm()) for x, y in zip(grads[name],
                                                                     references[kind]))

    result = {"graphs": graphs,
              "vs_eager": {n: vs_reference(n) for n in grads if n != "eager"},
              "bitwise": {c: all(torch.equal(a, b) for a, b in zip(
                  grads[f"{c}/True"], grads[f"{c}/False"]))
                  for c in (*compilers, "aot_eager+checkpoint", "aot_eager+simple_fsdp")}}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("compilers", [("aot_eager", "inductor")])
def test_retain_regathers_parameters_in_the_backward(tmp_path, compilers):
    spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), compilers), nprocs=2)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for compiler in (*compilers, "aot_eager+checkpoint", "aot_eager+simple_fsdp"):
            saved, regathered = got["graphs"][f"{compiler}/False"], \
                got["graphs"][f"{compiler}/True"]
            # Without: the partitioner never recomputes a collective, the backward gathers
            # nothing and the forward saves the gathered weights.
            assert saved["backward_gathers"] == 0 and saved["sites"] is None, saved
            # With: the three parameters' gathers are marked (w1 read twice, gathered once;
            # w2 cast to bf16 first); the backward runs those it reads again, w1's and w2's
            # (b1's gradient does not read b1). The input's gather is left alone.
            assert len(regathered["sites"]) == 3, regathered
            assert regathered["backward_gathers"] == 2, regathered
            assert len(regathered["skipped"]) == 1 and "not a parameter" in \
                regathered["skipped"][0], regathered
            # Gathered: w1 [12, 16] fp32 (768 bytes), b1 [12] fp32 (48), w2 [6, 12] bf16
            # (144). A kept call holds w1 and w2 (its 5 rows, [5, 12] bf16: 120 bytes, or the
            # whole padded 144) less: 1464 -> 552 bytes, 1296 -> 408 SimpleFSDP-like; b1 was
            # not saved either way.
            assert regathered["gathered_bytes"] == 12 * 16 * 4 + 12 * 4 + 6 * 12 * 2
            # and the forward the partitioner made saves none of the marked nodes (SimpleFSDP:
            # the block's second gather of w1 merged into the first, w2 times a buffer
            # recomputed with it)
            assert regathered["saved"] == [], regathered
            assert saved["kept"] - regathered["kept"] >= 12 * 16 * 4 + 5 * 12 * 2, \
                (saved["kept"], regathered["kept"])
            # A gather concatenates: the recomputed weights are the saved ones, bit for bit.
            assert got["bitwise"][compiler], got
            assert got["vs_eager"][f"{compiler}/True"] <= 1e-6, got["vs_eager"]
