"""What a user's loop does that the wrapper's own loops did not: each case found by an
adversarial pass over ``lean_compile(fn, schedule=...)`` (gradients against plain eager
autograd on the same loop), kept as a test under the default compiler (Inductor) and
``aot_eager``. Every case ends exact (within rounding), recomputed with a counted reason, or
refused with an error naming the fix; none with a wrong gradient or an internal error."""

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import leancompile
from leancompile.step import ReuseWarning

D, C, T, S, H, DH = 8, 3, 4, 4, 2, 4
COMPILERS = ["inductor", "aot_eager"]


class Policy(nn.Module):
    """An embedding of the step index and multi-head attention over S tokens, with the
    ``reshape(B, S, H, D).transpose(1, 2)`` views real transformers take."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(D + C, S * H * DH)
        self.temb = nn.Embedding(T, S * H * DH)
        self.qkv = nn.Linear(H * DH, 3 * H * DH)
        self.out = nn.Linear(S * H * DH, D)

    def forward(self, x, t, cond):
        b = x.shape[0]
        h = torch.tanh(self.inp(torch.cat([x, cond], -1)) + self.temb(t)).view(b, S, H * DH)
        q, k, v = (z.reshape(b, S, H, DH).transpose(1, 2) for z in self.qkv(h).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, S, H * DH)
        return self.out((h + a).reshape(b, -1))


def _grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()])


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def _phase(step, name, **kwargs):
    return contextlib.nullcontext() if step is None else getattr(step, name)(**kwargs)


def _rollout(fn, step, *, train=3, inference_mode=False, **kwargs):
    """Four sampling steps of four samples; returns the latents and the conditions."""
    g = torch.Generator().manual_seed(0)
    xs, cond = [torch.randn(4, D, generator=g)], torch.randn(4, C, generator=g)
    mode = torch.inference_mode() if inference_mode else torch.no_grad()
    with _phase(step, "rollout", train=train, **kwargs), mode:
        for k in range(T):
            xs.append(xs[-1] + 0.1 * fn(xs[-1], torch.full((4,), k), cond))
    return xs, cond


SHUFFLED = ((torch.tensor([2, 0]), torch.tensor([1, 3])))


def _update(fn, step, xs, cond, *, batches=SHUFFLED, steps=3, each=None):
    with _phase(step, "update"):
        for rows in batches:
            for k in range(steps):
                v = fn(xs[k][rows], torch.full((len(rows),), k), cond[rows])
                if each is not None:
                    v = each(v)
                v.square().mean().backward()


def _eager(base, *, between=None, inference_mode=False, **update_kwargs):
    model = copy.deepcopy(base)
    xs, cond = _rollout(model, None, inference_mode=inference_mode)
    xs = [x.clone() for x in xs]
    handle = between(model) if between is not None else None
    _update(model, None, xs, cond, **update_kwargs)
    if handle is not None:
        handle.remove()
    return _grads(model)


def _wrapped(base, compiler, schedule, *, between=None, inference_mode=False, **update_kwargs):
    model = copy.deepcopy(base)
    step = leancompile.lean_compile(model, backend=compiler, schedule=schedule)
    xs, cond = _rollout(step, step, inference_mode=inference_mode)
    handle = between(model) if between is not None else None
    _update(step, step, xs, cond, **update_kwargs)
    if handle is not None:
        handle.remove()
    return _grads(model), step


@pytest.fixture(scope="module")
def base():
    return Policy()


@pytest.mark.parametrize("compiler", COMPILERS)
def test_regrouped_rows_under_inductor_take_the_forward_strides(base, compiler):
    """FlowGRPO re-batches shuffled samples: the rows gathered from the kept tensors were
    contiguous, Inductor's backward asserts the forward's strides (attention's transposed
    q/k/v and its logsumexp): AssertionError 'expected size 2==2, stride 4==1'."""
    ref = _eager(base)
    for schedule in ("retain", "auto"):
        got, step = _wrapped(base, compiler, schedule)
        assert step.stats.mechanisms == {"gathered rows": 6}, step.stats.summary()
        assert _rel(got, ref) <= 1e-6, (schedule, _rel(got, ref))


def _log_prob_step(model):
    def log_prob(x, t, cond, target):
        return -((target - model(x, t, cond)) ** 2).mean(-1)
    return log_prob


def _reweight_loop(model, fn, step, *, plan, samples=False):
    g = torch.Generator().manual_seed(5)
    x0, cond = torch.randn(4, D, generator=g), torch.randn(4, C, generator=g)
    targets = [torch.randn(4, D, generator=g) for _ in range(T)]
    adv = torch.randn(4, generator=g)
    xs = [x0]
    extra = {"samples": torch.arange(4).repeat(T, 1)} if samples else {}
    with _phase(step, "rollout", train=3, **extra), torch.no_grad():
        for k in range(T):
            fn(xs[-1], torch.full((4,), k), cond, targets[k])
            xs.append(xs[-1] + 0.1 * targets[k])
    model.zero_grad(set_to_none=True)
    with _phase(step, "update"):
        for rows, k in plan:
            rows = torch.tensor(rows)
            lp = fn(xs[k][rows], torch.full((len(rows),), k), cond[rows], targets[k][rows])
            (-(adv[rows] * lp).mean()).backward()
    return _grads(model)


WHOLE = [([0, 1, 2, 3], k) for k in range(3)]
REGROUPED = [(rows, k) for rows in ([2, 0], [1, 3]) for k in range(3)]


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("plan,samples", [(WHOLE, False), (REGROUPED, False),
                                          (REGROUPED, True)])
def test_reweight_gradients_of_an_embedding(base, compiler, plan, samples):
    """vmap's rule for the embedding backward scatters into an expand of zeros; Inductor
    accumulated every row into the one shared buffer (the embedding's gradient off by a
    relative 1.08, the other parameters exact)."""
    reference = copy.deepcopy(base)
    ref = _reweight_loop(reference, _log_prob_step(reference), None, plan=plan)
    model = copy.deepcopy(base)
    step = leancompile.lean_compile(_log_prob_step(model), backend=compiler, schedule="reweight")
    got = _reweight_loop(model, step, step, plan=plan, samples=samples)
    assert step.stats.reused_calls == len(plan), step.stats.summary()
    assert step.stats.mechanisms == {"per-row gradients": len(plan)}
    emb = slice(sum(p.numel() for p in base.inp.parameters()),
                sum(p.numel() for p in base.inp.parameters()) + base.temb.weight.numel())
    assert _rel(got[emb], ref[emb]) <= 1e-5, _rel(got[emb], ref[emb])
    assert _rel(got, ref) <= 1e-5


def test_reweight_refuses_a_sample_step_served_twice(base):
    """``samples=``: one buffer per sample holds each trained step once; an update that serves
    one step twice (and another never) got the whole buffer (relative 0.35)."""
    model = copy.deepcopy(base)
    step = leancompile.lean_compile(_log_prob_step(model), backend="aot_eager",
                                    schedule="reweight")
    twice = [([0, 1], 0), ([0, 1], 1), ([0, 1], 0)]
    with pytest.raises(ValueError, match="serves a step of sample 0 a second time.*retain"):
        _reweight_loop(model, step, step, plan=twice, samples=True)


def _scale_mid_input(model):
    return model.out.register_forward_pre_hook(lambda module, args: (args[0] * 2.0,))


def _scale_output(model):
    return model.qkv.register_forward_hook(lambda module, args, out: out * 1.5)


def _global_pre(model):
    return register_module_forward_pre_hook(
        lambda module, args: (args[0] * 2.0,) if module is model.out else None)


def _global_post(model):
    return register_module_forward_hook(
        lambda module, args, out: out * 1.5 if module is model.qkv else None)


HOOKS = {"module pre-hook": _scale_mid_input, "module forward hook": _scale_output,
         "global pre-hook": _global_pre, "global forward hook": _global_post}


@pytest.mark.parametrize("compiler", COMPILERS)
def test_hooks_added_between_the_phases_are_run(base, compiler):
    """Dynamo skips the guards on modules' hook dicts by default and guards no global hook: a
    hook registered after the rollout was ignored under every schedule, recompute included
    (relative 0.51). The wrapper's calls guard them: the update runs the hook, and nothing
    the rollout kept (without it) is reused."""
    # (the guards are Dynamo's, the same whatever the schedule: one schedule per hook kind)
    schedules = ("recompute", "retain", "retain", "recompute")
    for (name, between), schedule in zip(HOOKS.items(), schedules):
        ref = _eager(base, between=between)
        torch._dynamo.reset()
        got, step = _wrapped(base, compiler, schedule, between=between)
        assert step.stats.reused_calls == 0, (name, step.stats.summary())
        assert _rel(got, ref) <= 1e-6, (name, schedule, _rel(got, ref))
    # and a hook removed between the phases: the rollout ran it, the update does not
    model = copy.deepcopy(base)
    handle = _scale_output(model)
    step = leancompile.lean_compile(model, backend=compiler, schedule="retain")
    xs, cond = _rollout(step, step)
    handle.remove()
    _update(step, step, xs, cond)
    reference = copy.deepcopy(base)
    _update(reference, None, xs, cond)
    assert step.stats.reused_calls == 0
    assert _rel(_grads(model), _grads(reference)) <= 1e-6


def test_a_hook_added_between_the_phases_is_run_by_a_function_step(base):
    """A step wrapping a function (not a module) cannot list the modules it runs: Dynamo's
    guards on their hook dicts stay on for it (a module's step notes its own hooks at each
    phase entry instead)."""
    ref = _eager(base, between=_scale_mid_input)
    model = copy.deepcopy(base)
    step = leancompile.lean_compile(lambda x, t, c: model(x, t, c), backend="aot_eager",
                                    schedule="retain")
    xs, cond = _rollout(step, step)
    handle = _scale_mid_input(model)
    _update(step, step, xs, cond)
    handle.remove()
    assert step.stats.reused_calls == 0, step.stats.summary()
    assert _rel(_grads(model), ref) <= 1e-6


@pytest.mark.parametrize("compiler", COMPILERS)
def test_an_update_output_edited_in_place_leaves_the_rollout_alone(base, compiler):
    """Served outputs aliased the kept ones: ``v.mul_(2)`` in the update rewrote the rollout's
    output the user held and what the backward read (relative 1.0)."""
    def run(model, fn, step):
        g = torch.Generator().manual_seed(0)
        xs, cond = [torch.randn(4, D, generator=g)], torch.randn(4, C, generator=g)
        vs = []
        with _phase(step, "rollout", train=3), torch.no_grad():
            for k in range(T):
                vs.append(fn(xs[-1], torch.full((4,), k), cond))
                xs.append(xs[-1] + 0.1 * vs[-1])
        before = torch.stack(vs).clone()
        with _phase(step, "update"):
            for k in range(3):
                v = fn(xs[k], torch.full((4,), k), cond)
                v.mul_(2.0)
                (v - vs[k]).square().mean().backward()
        assert torch.equal(torch.stack(vs), before)
        return _grads(model)

    reference = copy.deepcopy(base)
    ref = run(reference, reference, None)
    model = copy.deepcopy(base)
    step = leancompile.lean_compile(model, backend=compiler, schedule="retain")
    got = run(model, step, step)
    assert step.stats.reused_calls == 3
    assert _rel(got, ref) <= 1e-6


class TwoExperts(nn.Module):
    """Wan 2.2's two experts, chosen by the step: two graphs."""

    def __init__(self):
        super().__init__()
        self.hi, self.lo = Policy(0), Policy(1)

    def forward(self, x, t, cond):
        return (self.hi if int(t[0]) < 2 else self.lo)(x, t, cond)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_data_writes_to_the_parameters_of_a_second_graph(compiler):
    """The digest of the trainable parameters covered the first kept graph's only: a write
    through ``.data`` to the second expert was not seen (relative 0.48)."""
    base = TwoExperts()
    for which in ("hi", "lo"):
        def between(model, which=which):
            with torch.no_grad():
                for p in getattr(model, which).parameters():
                    p.data.mul_(1.5)
            return None
        ref = _eager(base, between=between, batches=(torch.arange(4),))
        got, step = _wrapped(base, compiler, "retain", between=between,
                             batches=(torch.arange(4),))
        assert step.stats.reused_calls == 0, step.stats.summary()
        assert any("written through .data" in r for r in step.stats.recomputed)
        assert _rel(got, ref) <= 1e-6, (which, _rel(got, ref))


class FFTAlongBatch(Policy):
    def forward(self, x, t, cond):
        h = super().forward(x, t, cond)
        return torch.fft.fft(h, dim=0).real  # mixes the samples, shapes unchanged


@pytest.mark.parametrize("compiler", COMPILERS)
def test_an_op_without_a_row_rule_is_not_regrouped(compiler):
    """The row-layout proof let every op it did not list through: an FFT along the batch
    passed, and regrouped rows got gradients off by 0.77. Now only ops a rule covers are
    row by row: the graph serves whole kept calls only, the regrouped calls recompute with
    the op named."""
    base = FFTAlongBatch()
    ref = _eager(base)
    got, step = _wrapped(base, compiler, "retain")
    assert step.stats.reused_calls == 0
    (reason,) = step.stats.recomputed
    assert "rows regrouped" in reason and "fft" in reason, reason
    assert _rel(got, ref) <= 1e-6


@pytest.mark.parametrize("compiler", COMPILERS)
def test_retain_graph_and_a_second_backward(base, compiler):
    """``autograd.grad(..., retain_graph=True)`` for logging then ``backward()`` raised
    ``TypeError: 'NoneType' object is not callable`` under every schedule; a second backward
    without ``retain_graph`` gets autograd's own error; ``create_graph=True`` (a gradient
    penalty) raises instead of returning gradients without a graph."""
    x, cond, t = torch.randn(4, D), torch.randn(4, C), torch.zeros(4, dtype=torch.long)
    reference = copy.deepcopy(base)
    loss = reference(x, t, cond).square().mean()
    logged = torch.autograd.grad(loss, list(reference.parameters()), retain_graph=True)
    loss.backward()
    for schedule, phase in (("recompute", False), ("retain", False), ("retain", True)):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        step = leancompile.lean_compile(model, backend=compiler, schedule=schedule)
        if phase:
            with step.rollout(), torch.no_grad():
                step(x, t, cond)
        with step.update() if phase else contextlib.nullcontext():
            loss = step(x, t, cond).square().mean()
            got = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            loss.backward()
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()
            with pytest.raises(RuntimeError, match="create_graph=True"):
                torch.autograd.grad(step(x, t, cond).square().mean(),
                                    list(model.parameters()), create_graph=True)
        assert step.stats.reused_calls == int(phase)
        assert _rel(torch.cat([g.flatten() for g in got]),
                    torch.cat([g.flatten() for g in logged])) <= 1e-6
        assert _rel(_grads(model), _grads(reference)) <= 1e-6


class TokenVelocity(nn.Module):
    """A velocity over S tokens of width D (``[B, S, D]``, FLUX's packed latents) and a
    timestep: its Linear on a 3-D input is what a strided input traces differently."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(D, 16), nn.Linear(16, D)

    def forward(self, x, t):
        return self.out(F.gelu(self.inp(x) + t[:, None, None]))


def _token_loop(fn, step):
    """FlowGRPO's ``train_flux.py`` without its model: sampling with dense latents and a
    dense timestep, then training on a column of the stacked trajectory
    (``sample["latents"][:, j]``, strided: no classifier-free guidance ``cat`` makes it dense
    as in the SD3 loop) and a stride-0 ``expand(B)``, shuffled rows."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, S, D, generator=g)]
    with _phase(step, "rollout", train=3), torch.no_grad():
        for k in range(T):
            xs.append(xs[-1] + 0.1 * fn(xs[-1], torch.full((4,), k / T)))
    trajectory = torch.stack(xs, 1)  # [B, T + 1, S, D]
    with _phase(step, "update"):
        for rows in SHUFFLED:
            batch = trajectory[rows]
            for k in range(3):
                v = fn(batch[:, k], torch.tensor(k / T).expand(len(rows)))
                v.square().mean().backward()


@pytest.mark.parametrize("compiler", COMPILERS)
def test_strided_update_inputs_reuse_the_rollout(compiler):
    """A strided input traces another aten graph (the Linear on ``[B, S, D]`` that a view
    cannot flatten: ``expand`` + ``bmm`` instead of ``view`` + ``addmm``): no kept call
    computed the same function, and Retain reused 0 of 6 calls (gradients right, nothing
    saved; FlowGRPO's FLUX loop on a tiny FLUX: 0 of 6 first-window calls). The step lays
    such inputs out densely before Dynamo sees them (``lean/inputs.py``)."""
    reference = TokenVelocity()
    _token_loop(reference, None)
    model = TokenVelocity()
    step = leancompile.lean_compile(model, backend=compiler, schedule="retain")
    _token_loop(step, step)
    assert step.stats.reused_calls == 6, step.stats.summary()
    assert _rel(_grads(model), _grads(reference)) <= 1e-6


def test_dense_inputs_keep_formats_and_gradients():
    """What ``lean/inputs.py`` copies: strided plain tensors, at the top level and in tuples,
    one copy per tensor. What it leaves: lists and dicts with what they hold (the step may
    write into them), an expand (its copy could be many times its memory), an
    ``nn.Parameter`` (a copy would be no parameter), a dense, channels-last or sparse tensor
    (a sparse one's ``.contiguous()`` raises). The copy is differentiable: the gradient
    reaches the caller's tensor; an output that is a copy is given back as the caller's."""
    from leancompile.lean.inputs import densely, given_back

    x = torch.randn(4, 3, 5, requires_grad=True)
    column = torch.stack([x, x], 1)[:, 0]
    listed = [torch.stack([x, x], 1)[:, 1]]
    expand = torch.tensor(1.0).expand(4)
    param = nn.Parameter(torch.randn(5, 3).t())
    cl = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    sparse, dense = torch.eye(3).to_sparse(), torch.randn(3)
    nested = {"sparse": sparse, "dense": dense}
    args, kwargs, copies = densely((column, (column, expand), listed),
                                   {"cl": cl, "nested": nested, "param": param})
    assert args[0].is_contiguous() and torch.equal(args[0], column)
    assert args[1][0] is args[0] and args[1][1] is expand  # one copy; the expand as it was
    assert args[2] is listed and kwargs["nested"] is nested  # containers not rebuilt
    assert kwargs["cl"] is cl and kwargs["param"] is param
    assert copies == {id(args[0]): column}
    assert given_back((args[0], [args[0], dense]), copies) == (column, [column, dense])
    args[0].sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 1.0))


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_strided_call_keeps_what_the_caller_sees(compiler):
    """The dense copy (``lean/inputs.py``) changes nothing a caller sees: a dict the step
    writes into is the caller's, an output that is the input is the caller's tensor, a
    parameter passed as an argument (strided: ``W.t()`` of a parameter made so) stays a
    parameter and the calls reuse. (The first version of the copy rebuilt every container,
    turned such a parameter into a plain tensor, 0 of 3 reused, and gave the copy back.)"""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(D, 5).t())  # [5, D], strided

    def f(x, w, cache):
        h = torch.tanh(x @ w)
        cache["h"] = h + 0
        return x, h

    step = leancompile.lean_compile(f, backend=compiler, schedule="retain")
    xs = torch.randn(4, 3, 5)
    with step.rollout(), torch.no_grad():
        for k in range(3):
            step(xs[:, k].contiguous(), weight, {})
    with step.update():
        for k in range(3):
            cache, x = {}, xs[:, k]  # strided
            out, h = step(x, weight, cache)
            assert out is x and torch.equal(cache["h"], h.detach())
            h.square().sum().backward()
    assert step.stats.reused_calls == 3, step.stats.summary()
    expected = torch.autograd.grad(
        sum(torch.tanh(xs[:, k] @ weight).square().sum() for k in range(3)), weight)[0]
    assert _rel(weight.grad, expected) <= 1e-6


class CheckpointedAttention(nn.Module):
    """Attention under ``torch.utils.checkpoint`` (FlowGRPO's ``train_wan2_1.py`` turns
    diffusers' gradient checkpointing on; DanceGRPO's FLUX script passes
    ``--gradient_checkpointing``), a per-row scalar out (what Reweight needs). ``mix``: a batch
    mean inside the checkpointed region (rows of different samples meet there); ``p``: the
    attention's dropout."""

    def __init__(self, *, mix=False, p=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, 1)
        self.mix, self.p = mix, p

    def block(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, H, D // H)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        a = a.transpose(1, 2).flatten(2)
        return x + (a + a.mean(0) if self.mix else a)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.out(checkpoint(self.block, x, use_reentrant=False)).mean((1, 2))


def _checkpointed_loop(model, compiler, schedule):
    """Two rollout calls of two rows, then an update on rows 0 and 2 (one of each call);
    returns the step and the gradients (eager's when ``compiler`` is None)."""
    torch.manual_seed(1)
    x = torch.randn(4, S, D)
    weights = torch.tensor([1.0, -2.0])
    if compiler is None:
        (model(x[[0, 2]]) * weights).sum().backward()
        return None, _grads(model)
    step = leancompile.lean_compile(model, backend=compiler, schedule=schedule)
    with step.rollout(), torch.no_grad():
        step(x[:2])
        step(x[2:])
    with step.update(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ReuseWarning)
        (step(x[[0, 2]]) * weights).sum().backward()
    return step, _grads(model)


@pytest.mark.parametrize("compiler, schedule, mechanism", [
    ("inductor", "retain", "gathered rows"), ("aot_eager", "retain", "gathered rows"),
    ("aot_eager", "reweight", "per-row gradients"), ("aot_eager", "auto", "gathered rows")])
def test_checkpointed_attention_reuses_the_rollout(compiler, schedule, mechanism):
    """Torch's checkpointing wraps an attention op in ``run_and_save_rng_state`` (its
    random-number tag, whatever ``dropout_p``). The step was refused as drawing random numbers;
    the check now reads the wrapped op's ``dropout_p`` (0: draws nothing), the row analysis
    follows the wrapper as the op it calls, and Reweight's vmapped backward calls the op bare
    (vmap has no rule for the wrapper). The update's regrouped rows are served from the
    rollout's calls, with eager's gradients."""
    _, want = _checkpointed_loop(CheckpointedAttention().eval(), None, None)
    step, got = _checkpointed_loop(CheckpointedAttention().eval(), compiler, schedule)
    assert step.stats.mechanisms == {mechanism: 1}, (step.stats.mechanisms,
                                                     step.stats.recomputed)
    assert _rel(got, want) <= 1e-6


def test_a_batch_mean_inside_a_checkpointed_region_is_not_regrouped():
    """Found by an adversarial probe once the check above let checkpointed attention through:
    the partitioner's wrapper node has no traced value, and the row analysis gave a node it
    could not see into the layout "no batch", so a batch mean of the attention inside the
    checkpointed region was taken for row-local, and the regrouped update was served from
    gathered rows (outputs 0.53 off, gradients 0.36 relative). A node the analysis cannot see
    into is now "rows meet"; the wrapper is followed as its op, and the mean is named."""
    _, want = _checkpointed_loop(CheckpointedAttention(mix=True).eval(), None, None)
    step, got = _checkpointed_loop(CheckpointedAttention(mix=True).eval(), "aot_eager",
                                   "retain")
    assert step.stats.reused_calls == 0
    (reason, count), = step.stats.recomputed.items()
    assert count == 1 and "aten.mean.dim" in reason and "reduces over the batch" in reason
    assert _rel(got, want) <= 1e-6


def test_checkpointed_dropout_is_refused_with_fixes_that_fix_it():
    """A checkpointed attention that does draw: ``dropout_p > 0`` in training, and
    ``dropout_p > 0`` passed to ``F.scaled_dot_product_attention`` by a model in ``eval()``
    (the argument, not the module's mode, decides). Two runs of it are not the same forward:
    refused, naming the fixes that fix it. Turning checkpointing off is not one (the
    adversarial review: the message named it, and the op draws without checkpointing too);
    ``dropout_p=0`` is."""
    from leancompile.capture import RandomOpInGraphError

    class AlwaysDrops(CheckpointedAttention):
        def block(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, H, D // H)).permute(2, 0, 3, 1, 4)
            return x + F.scaled_dot_product_attention(q, k, v, dropout_p=0.3).transpose(
                1, 2).flatten(2)

    for model in (CheckpointedAttention(p=0.1).train(), AlwaysDrops().eval()):
        step = leancompile.lean_compile(model, backend="aot_eager", schedule="retain")
        with pytest.raises(RandomOpInGraphError, match="dropout_p=0 to attention calls") as e, \
                step.rollout(), torch.no_grad():
            step(torch.randn(2, S, D))
        assert "checkpointing" not in str(e.value), e.value


def test_a_view_of_an_input_that_requires_grad_is_refused_with_the_fix():
    """A step returning ``x[:, 0]`` (or ``x.t()``) of an ``x`` that requires grad: the step's
    backward graph has no tangent for such an output (AOTAutograd regenerates the view on the
    input outside its graph), and the backward raised an internal error ("dimensionality of
    sizes (1) must match dimensionality of strides (2)", "forward() takes 5 positional
    arguments but 6 were given"). Refused at the first call with the fix; returning the input
    itself, or a view of an input without grad, still runs."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 5)
    x = torch.randn(4, 5, requires_grad=True)
    for view in (lambda v: v[:, 0], lambda v: v.t()):
        step = leancompile.lean_compile(lambda v, view=view: (view(v), lin(v)),
                                        backend="aot_eager", schedule="retain")
        with pytest.raises(Exception, match="is a view of its input .*requires grad.*clone"):
            step(x)
    step = leancompile.lean_compile(lambda v: (v, lin(v)), backend="aot_eager",
                                    schedule="retain")
    a, b = step(x)
    (a.square().sum() + b.square().sum()).backward()
    got = x.grad.clone()
    x.grad = None
    (x.square().sum() + lin(x).square().sum()).backward()
    assert torch.equal(got, x.grad)


def test_a_wrapper_subclass_argument_is_refused_with_the_fix():
    """A tensor subclass that wraps inner tensors (torch's ``TwoTensor``; a DTensor alike)
    reaches the traced graphs as its inner tensors: the step's own bookkeeping of inputs
    raised an internal ``IndexError``. Refused, naming the argument and the fix."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    lin = nn.Linear(5, 5)
    step = leancompile.lean_compile(lambda x, y: lin(x) + y.sum(), backend="aot_eager",
                                    schedule="retain")
    y = TwoTensor(torch.randn(4, 5), torch.randn(4, 5))
    with pytest.raises(Exception, match=r"plain tensors.*TwoTensor.*to_local"):
        step(torch.randn(4, 5), y)


def test_the_reuse_warning_names_every_reason(base):
    """Two optimizer steps per rollout: the second window's "parameters changed" counts as many
    calls as whatever stopped the first window, and the warning named one reason of a tie
    (the alphabetically last), so the first window's own reason went unsaid (FlowGRPO's FLUX
    loop: its strided inputs, above)."""
    model = copy.deepcopy(base)
    step = leancompile.lean_compile(model, backend="aot_eager", schedule="retain")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, cond = _rollout(step, step)
    with pytest.warns(ReuseWarning) as record, step.update():
        for window, rows in enumerate(SHUFFLED):
            for k in range(3):
                x = xs[k][rows] + (1.0 if window == 0 else 0.0)  # the first: never sampled
                step(x, torch.full((2,), k), cond[rows]).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    message = str(record[0].message)
    assert "0 of 6 calls" in message, message
    assert "(3 x) inputs not seen" in message, message  # (one cause, whichever row)
    assert "(3 x) the parameters changed" in message, message


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_rollout_under_inference_mode(base, compiler):
    """``torch.inference_mode()`` around the sampling loop raised "Inference tensors do not
    track version counter". The trained calls keep normal tensors (copies of inference-tensor
    inputs); the update reuses them."""
    ref = _eager(base, inference_mode=True)
    got, step = _wrapped(base, compiler, "retain", inference_mode=True)
    assert step.stats.reused_calls == 6, step.stats.summary()
    assert _rel(got, ref) <= 1e-6


def test_the_module_wrapper_is_the_module_for_all_but_the_call(base):
    """``lean_compile(module, schedule=...)`` (a user's first try,
    ``pipeline.transformer = lean_compile(pipeline.transformer, ...)``) raised
    ``AttributeError: 'LeanStep' object has no attribute 'eval'``."""
    model = copy.deepcopy(base)
    model.config = {"in_channels": D}  # what diffusers models carry
    wrapped = leancompile.lean_compile(model, backend="aot_eager", schedule="retain")
    assert isinstance(wrapped, nn.Module) and wrapped.module is model
    assert wrapped.config["in_channels"] == D and wrapped.qkv is model.qkv
    assert list(wrapped.state_dict()) == list(model.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    # the same names at every level: under a parent (DDP's "module."), state_dict and
    # named_parameters agree, and the parent's checkpoint loads back
    parent = nn.ModuleDict({"module": wrapped})
    assert list(parent.state_dict()) == [f"module.{n}" for n in model.state_dict()]
    assert [n for n, _ in parent.named_parameters()] == \
        [f"module.{n}" for n, _ in model.named_parameters()]
    parent.load_state_dict(parent.state_dict())
    wrapped.eval()
    assert not model.training
    wrapped.train()
    assert model.training
    fresh = Policy(seed=3)
    wrapped.load_state_dict(fresh.state_dict())
    assert torch.equal(model.qkv.weight, fresh.qkv.weight)
    with pytest.raises(AttributeError, match="no_such_thing"):
        wrapped.no_such_thing
    ref = _eager(fresh)
    xs, cond = _rollout(wrapped, wrapped)  # (arguments by position)

    def by_keyword(x, t, cond_):
        return wrapped(x=x, t=t, cond=cond_)

    _update(by_keyword, wrapped, xs, cond)
    assert wrapped.stats.reused_calls == 6 and _rel(_grads(model), ref) <= 1e-6
    # A deep copy (a reference or EMA model) is the copied module under a step of its own.
    copied = copy.deepcopy(wrapped)
    assert copied.module is not model and copied.lean_step is not wrapped.lean_step
    with torch.no_grad():
        copied.module.out.weight.mul_(2)
        x = torch.randn(4, D)
        t = torch.zeros(4, dtype=torch.long)
        cond = torch.zeros(4, C)
        assert torch.allclose(copied(x, t, cond), copied.module(x, t, cond))
        assert not torch.allclose(copied(x, t, cond), model(x, t, cond))


def test_trajectory_steps_train_the_first_steps_of_every_sampling_batch(base):
    """FlowGRPO samples several batches of T steps: ``train=range(n)`` alone trains the first
    n calls of the whole rollout (0 of the update's calls reused, silently). With
    ``trajectory_steps=T`` it trains the first n steps of every batch; an update that reuses
    less than half of its calls warns, naming the reason; no-grad calls inside ``update()``
    (a KL reference) are counted."""
    model = copy.deepcopy(base)
    step = leancompile.lean_compile(model, backend="aot_eager", schedule="retain")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, D, generator=g), torch.randn(4, C, generator=g))
               for _ in range(3)]

    def sample(**kwargs):
        trajectories = []
        with step.rollout(**kwargs), torch.no_grad():
            for x, cond in batches:
                xs = [x]
                for k in range(T):
                    xs.append(xs[-1] + 0.1 * step(xs[-1], torch.full((4,), k), cond))
                trajectories.append((xs, cond))
        return trajectories

    def train(trajectories):
        with step.update():
            for xs, cond in trajectories:
                for k in range(2):
                    step(xs[k], torch.full((4,), k), cond).square().mean().backward()
                    with torch.no_grad():
                        step(xs[k], torch.full((4,), k), cond)

    with pytest.warns(ReuseWarning, match="2 of 6 calls.*trajectory_steps"):
        train(sample(train=range(2)))
    before = step.reset_stats()
    assert before.reused_calls == 2 and before.no_grad_calls == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReuseWarning)
        train(sample(train=range(2), trajectory_steps=T))
    assert step.stats.reused_calls == 6 and step.stats.no_grad_calls == 6
    assert "6 no-grad calls" in step.stats.summary()
    with pytest.raises(ValueError, match="trajectory_steps=0"):
        with step.rollout(trajectory_steps=0):
            pass


@pytest.mark.parametrize("compiler,reference", [("inductor", "inductor"),
                                                ("aot_eager", "aot_eager_decomp_partition")])
def test_which_plain_compile_each_schedule_is_bitwise_equal_to(base, compiler, reference):
    """What "the same gradients" means, exactly. The wrapper traces with Inductor's
    decompositions and the min-cut partitioner whatever the backend, so recompute is bitwise
    equal to plain ``torch.compile`` with ``backend="inductor"``, and with ``aot_eager`` to
    ``torch.compile(backend="aot_eager_decomp_partition")`` (plain ``"aot_eager"``
    decomposes nothing: 1e-8 apart here, amplified by a log-prob's small variance on a real
    loop). Retain equals recompute bitwise when the update's batches are the rollout's
    (regrouped rows are computed at another batch size, which may round a row differently)."""
    whole = (torch.arange(4),)
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    plain = torch.compile(model, backend=reference)
    xs, cond = _rollout(plain, None)
    _update(plain, None, xs, cond, batches=whole)
    ref = _grads(model)
    for schedule in ("recompute", "retain"):
        torch._dynamo.reset()
        got, step = _wrapped(base, compiler, schedule, batches=whole)
        assert step.stats.reused_calls == (3 if schedule == "retain" else 0)
        assert torch.equal(got, ref), (schedule, _rel(got, ref))


class PermutedOutput(Policy):
    """An output left permuted, as SD3's unpatchify einsum leaves it (channels last): its
    tangent was traced with those strides."""

    def forward(self, x, t, cond):
        v = super().forward(x, t, cond)
        return v.view(-1, 2, 2, 2).permute(0, 3, 1, 2)  # [B, c, h, w], c of stride 1


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_permuted_output_gets_its_traced_tangent_strides(compiler):
    """The backward's tangents were handed over contiguous; Inductor's backward asserts the
    strides it traced (SD3 under Inductor: AssertionError 'expected size 4==4, stride 16==1'
    in every wrapped update call, recompute included)."""
    base = PermutedOutput()

    def run(model, fn, step):
        g = torch.Generator().manual_seed(0)
        xs, cond = [torch.randn(4, D, generator=g)], torch.randn(4, C, generator=g)
        with _phase(step, "rollout", train=3), torch.no_grad():
            for k in range(T):
                xs.append(xs[-1] + 0.1 * fn(xs[-1], torch.full((4,), k), cond).flatten(1))
        with _phase(step, "update"):
            for rows in SHUFFLED:
                for k in range(3):
                    v = fn(xs[k][rows], torch.full((2,), k), cond[rows])
                    (v * torch.arange(8.0).view(1, 2, 2, 2)).square().mean().backward()
        return _grads(model)

    reference = copy.deepcopy(base)
    ref = run(reference, reference, None)
    for schedule in ("recompute", "retain"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        step = leancompile.lean_compile(model, backend=compiler, schedule=schedule)
        got = run(model, step, step)
        assert step.stats.reused_calls == (6 if schedule == "retain" else 0)
        assert _rel(got, ref) <= 1e-6, (schedule, _rel(got, ref))


def test_a_one_row_call_of_an_untrained_row_says_inputs_not_seen():
    """Dynamo specialises a batch of 1 into its own graph, matched to the kept graph through a
    trace at 1; the reason for a miss compared the batch-1 graph's own fingerprint and blamed
    "another graph" (found by the property tests)."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    step = leancompile.lean_compile(layer, backend="aot_eager", schedule="retain")
    xs = [torch.randn(2, 4)]
    with step.rollout(train={0}), torch.no_grad():
        for _ in range(2):
            xs.append(step(xs[-1]))
    with step.update():
        step(xs[0][:1]).sum().backward()  # trained: served
        step(xs[1][:1]).sum().backward()  # not trained
    assert step.stats.reused_calls == 1
    assert dict(step.stats.recomputed) == {"row 0: inputs not seen in the rollout": 1}


def test_inductor_cache_hit_plans_and_computes_as_a_fresh_compile(base, tmp_path, monkeypatch):
    """The wrapper's Inductor graphs go through Inductor's FX graph cache (the suite and users
    re-compile the same step often). A hit skips Inductor's post-grad passes, ours included:
    the wrapper then runs the pipeline on the same graph for its report and row layouts. A
    second step (another schedule: the key does not hold it) served from the cache plans,
    reports and computes as the first, which compiled."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    ref = _eager(base)
    seen = []
    for schedule in ("retain", "auto"):
        torch._dynamo.reset()
        hits = counters["inductor"]["fxgraph_cache_hit"]
        with torch._inductor.config.patch(fx_graph_cache=True):
            got, step = _wrapped(base, "inductor", schedule)
        seen.append((counters["inductor"]["fxgraph_cache_hit"] - hits, step))
        assert step.stats.mechanisms == {"gathered rows": 6}, step.stats.summary()
        assert _rel(got, ref) <= 1e-6, (schedule, _rel(got, ref))
    (first_hits, first), (second_hits, second) = seen
    assert first_hits == 0 and second_hits >= 3, (first_hits, second_hits)  # fw, bw, inference

    def records(step):
        return [(g.phase, [(p.name, len(p.rewritten), len(p.skipped)) for p in g.passes])
                for r in step.reports for g in r.graphs]
    assert records(second) == records(first) and any(
        name == "lean_grpo" and n for _, passes in records(first) for name, n, _ in passes)


def test_reweight_served_from_the_inductor_cache_regroups_rows_as_compiled(base, tmp_path,
                                                                           monkeypatch):
    """Reweight reads the row layouts the pipeline records on the forward graph; a second
    wrapped copy of the step (a user's second run, or a reference copy) is served from
    Inductor's cache, where the pipeline runs only for that record: its per-row gradients over
    regrouped rows still equal eager's."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    reference = copy.deepcopy(base)
    ref = _reweight_loop(reference, _log_prob_step(reference), None, plan=REGROUPED)
    hits = []
    for _ in range(2):
        torch._dynamo.reset()
        before = counters["inductor"]["fxgraph_cache_hit"]
        model = copy.deepcopy(base)
        step = leancompile.lean_compile(_log_prob_step(model), backend="inductor",
                                        schedule="reweight")
        with torch._inductor.config.patch(fx_graph_cache=True):
            got = _reweight_loop(model, step, step, plan=REGROUPED)
        hits.append(counters["inductor"]["fxgraph_cache_hit"] - before)
        assert step.stats.mechanisms == {"per-row gradients": len(REGROUPED)}, \
            step.stats.summary()
        assert _rel(got, ref) <= 1e-5, _rel(got, ref)
    assert hits[0] == 0 and hits[1] >= 2, hits


def test_two_backwards_through_a_reused_call_under_inductor():
    """``loss.backward(retain_graph=True)`` then ``loss.backward()`` on an update call that
    reused the rollout: both backwards read the kept tensors. Inductor's backward donated them
    as scratch (AOTAutograd's ``donated_buffer``), and the second read overwritten ones: a
    gradient off by 64 against eager's. The capture traces without donated buffers."""
    from test_lean_step import _sampling_step

    layer, step_fn, x, noise, step = _sampling_step("inductor")
    with step.rollout(), torch.no_grad():
        sample, _ = step(x, noise=noise)
    layer.zero_grad()
    with step.update():
        _, log_prob = step(x, prev_sample=sample)
        loss = (log_prob * torch.arange(4.0)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert step.stats.reused_calls == 1, step.stats.summary()
    got = layer.weight.grad.clone()
    layer.zero_grad()
    loss = (step_fn(x, prev_sample=sample)[1] * torch.arange(4.0)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(got, layer.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("small", [True, False])
def test_rows_of_two_sampling_batches_regrouped_under_inductor(base, small, monkeypatch):
    """FlowGRPO's loop: two sampling batches of T steps (``trajectory_steps``), the samples
    shuffled into update batches that mix both, so each update call gathers its rows from two
    kept calls (``RowGather``: the sources concatenated and one index_select, or, above
    ``SMALL_BYTES``, run by run); the update's loss is backpropagated twice
    (``retain_graph=True``, as a loop logging a gradient norm first) and one output is edited
    in place. Gradients equal eager autograd's on the same loop, Inductor."""
    if not small:
        monkeypatch.setattr(leancompile.runtime.reuse.RowGather, "SMALL_BYTES", 0)

    def loop(model, fn, step, outs):
        g = torch.Generator().manual_seed(0)
        batches = []
        with _phase(step, "rollout", train=3, trajectory_steps=T), torch.no_grad():
            for _ in range(2):
                xs, cond = [torch.randn(4, D, generator=g)], torch.randn(4, C, generator=g)
                for k in range(T):
                    xs.append(xs[-1] + 0.1 * fn(xs[-1], torch.full((4,), k), cond))
                batches.append((torch.stack(xs[:T]), cond))
        xs = torch.cat([b[0] for b in batches], 1)  # [T, 8 samples, D]
        cond = torch.cat([b[1] for b in batches])
        model.zero_grad()
        with _phase(step, "update"):
            for rows in (torch.tensor([5, 0, 6, 3]), torch.tensor([1, 7, 2, 4])):
                for k in range(3):
                    v = fn(xs[k][rows], torch.full((4,), k), cond[rows])
                    v.mul_(2.0)
                    outs.append(v.detach().clone())
                    # rows weighted apart: a gather that permuted rows would show
                    loss = (v.square().sum(1) * torch.arange(1.0, 5.0)).mean()
                    loss.backward(retain_graph=True)
                    loss.backward()
        return _grads(model)

    ref_outs, outs = [], []
    reference = copy.deepcopy(base)
    ref = loop(reference, reference, None, ref_outs)
    model = copy.deepcopy(base)
    step = leancompile.lean_compile(model, backend="inductor", schedule="retain")
    got = loop(model, step, step, outs)
    stats = step.stats
    assert stats.reused_calls == 6 and stats.forwards_run == 0, stats.summary()
    assert stats.mechanisms["gathered rows"] == 6, stats.summary()
    assert _rel(got, ref) <= 1e-5, _rel(got, ref)
    assert _rel(torch.stack(outs), torch.stack(ref_outs)) <= 1e-5


def _flow_grpo_step(model):
    """DanceGRPO's spelling of a sampling step (``flux_step``): the next latent drawn when no
    ``prev_sample`` is given, and the one given returned as it is, with the log-prob of its
    detached value and the mean. (FlowGRPO's ``sde_step_with_logprob`` returns
    ``prev_sample.float()``, an alias inside the graph, which matched before.)"""
    def step(x, t, cond, noise=None, prev_sample=None):
        mean = x + 0.1 * model(x, t, cond)
        if prev_sample is None:
            prev_sample = mean + 0.3 * noise
        log_prob = -((prev_sample.detach() - mean) ** 2).mean(-1) / 0.18
        return prev_sample, log_prob, mean
    return step


def _flow_grpo_loop(fn, step, plan, *, mean_term=True):
    """Two sampling batches of 4 (T steps, the first 3 trained), then update calls on the
    ``plan``'s rows of the 8 samples at each trained step: PPO's ratio of the log-probs (and a
    KL-like term on the mean: not for Reweight, which serves log-probs only), ``backward`` per
    call. Returns (the sample each update call got back and its prev_sample argument, per
    call)."""
    g = torch.Generator().manual_seed(3)
    xs, cond, lps = [], torch.randn(8, C, generator=g), []
    with _phase(step, "rollout", train=3, trajectory_steps=T), torch.no_grad():
        for b in range(2):
            traj, lp = [torch.randn(4, D, generator=g)], []
            for k in range(T):
                noise = torch.randn(4, D, generator=g)
                sample, log_prob, _ = fn(traj[-1], torch.full((4,), k), cond[4 * b:4 * b + 4],
                                         noise=noise)
                traj.append(sample)
                lp.append(log_prob)
            xs.append(torch.stack(traj, 1))
            lps.append(torch.stack(lp, 1))
    xs, lps = torch.cat(xs), torch.cat(lps)  # [8, T + 1, D], [8, T]
    adv = torch.linspace(-1, 1, 8)
    returned = []
    with _phase(step, "update"):
        for rows, k in plan:
            rows = torch.tensor(rows)
            given = xs[rows, k + 1]
            sample, log_prob, mean = fn(xs[rows, k], torch.full((len(rows),), k), cond[rows],
                                        prev_sample=given)
            returned.append((sample, given))
            ratio = torch.exp(log_prob - lps[rows, k])
            loss = -(adv[rows] * ratio).mean()
            (loss + 0.01 * mean.square().mean() if mean_term else loss).backward()
    return returned


MIXED = [(rows, k) for rows in ([5, 0, 6, 3], [1, 7, 2, 4]) for k in range(3)]
ONE_BY_ONE = [([i], k) for i in (6, 1, 3) for k in range(3)]  # DanceGRPO: batch 1


@pytest.mark.parametrize("compiler,schedule,plan", [
    ("inductor", "retain", MIXED), ("inductor", "retain", ONE_BY_ONE),
    ("aot_eager", "reweight", MIXED)])
def test_a_step_returning_the_given_sample_as_it_is_reuses_the_rollout(compiler, schedule,
                                                                       plan):
    """DanceGRPO's SDE step returns the ``prev_sample`` it was given: Dynamo returns that input
    outside the update's graph, which then has one output fewer than the rollout's, and no
    update call matched a kept one (0 of 6 reused: "no kept rollout call computes the same
    function"). Now every call is served, the sample returned is the tensor passed in, and the
    gradients equal eager autograd's on the same loop, regrouped rows and batch-1 calls alike."""
    mean_term = schedule == "retain"
    reference = Policy(seed=1)
    _flow_grpo_loop(_flow_grpo_step(reference), None, plan, mean_term=mean_term)
    model = Policy(seed=1)
    step = leancompile.lean_compile(_flow_grpo_step(model), backend=compiler, schedule=schedule,
                                    sample_output=0, sample_arg="prev_sample")
    returned = _flow_grpo_loop(step, step, plan, mean_term=mean_term)
    stats = step.stats
    assert stats.reused_calls == stats.update_calls == len(plan), stats.summary()
    assert stats.forwards_run == 0, stats.summary()
    assert all(sample is given for sample, given in returned)
    assert _rel(_grads(model), _grads(reference)) <= 1e-5, _rel(_grads(model), _grads(reference))


class ConvPolicy(nn.Module):
    """Convolutions on channels-last activations (a UNet's layout): Inductor's layout
    optimisation returns saved tensors (the convolution's weight laid out channels-last) with
    other strides than the graph was traced with."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x, t):
        h = torch.relu(self.c1(x.contiguous(memory_format=torch.channels_last)))
        return self.c2(h * t.view(-1, 1, 1, 1).float())


def _conv_loop(model, step, plan, autocast=False):
    g = torch.Generator().manual_seed(1)
    fn = step or model
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast \
        else contextlib.nullcontext
    xs = [torch.randn(4, 3, 6, 6, generator=g)]
    with _phase(step, "rollout", train=3), torch.no_grad(), cast():
        for k in range(3):
            xs.append(xs[-1] + 0.1 * fn(xs[-1], torch.full((4,), k)).float())
    model.zero_grad()
    with _phase(step, "update"), cast():
        for rows in plan:
            for k in range(3):
                r = torch.tensor(rows)
                out = fn(xs[k][r], torch.full((len(rows),), k)).float()
                (out.square().sum((1, 2, 3)) * torch.arange(1.0, len(rows) + 1)).sum().backward()
    return _grads(model)


@pytest.mark.parametrize("schedule,autocast", [("recompute", False), ("retain", False),
                                               ("retain", True)])
def test_channels_last_convolutions_under_inductor(schedule, autocast):
    """Inductor's forward returned a convolution's saved weight contiguous where the backward,
    compiled from the traced graph, asserts channels-last: "expected size 8==8, stride 1==9"
    in every schedule, recompute included. Saved tensors are now laid out as traced before
    the backward; regrouped rows and a batch-1 call give eager autograd's gradients, under
    bf16 autocast too."""
    plan = ([2, 0, 3], [1])
    reference = ConvPolicy()
    ref = _conv_loop(reference, None, plan, autocast)
    model = ConvPolicy()
    step = leancompile.lean_compile(model, backend="inductor", schedule=schedule)
    got = _conv_loop(model, step, plan, autocast)
    assert step.stats.reused_calls == (6 if schedule == "retain" else 0), step.stats.summary()
    assert _rel(got, ref) <= 1e-5, _rel(got, ref)
    # Which saved tensors come back relaid is read from the strides Inductor reports for the
    # forward (a backward lays out only those): the convolutions' here, none for a Linear's
    # (a graph whose forward never ran, all its calls reused, knows nothing yet)
    relaid = [g.saved_relaid for g in step.graphs if "forward" in g.compiled]
    assert relaid and all(isinstance(r, frozenset) and r for r in relaid), relaid
    if schedule == "recompute" and not autocast:
        mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        plain = leancompile.lean_compile(mlp, backend="inductor", schedule="recompute")
        plain(torch.randn(3, 4)).sum().backward()
        assert [g.saved_relaid for g in plain.graphs] == [frozenset()]


class Conv3dPolicy(nn.Module):
    """3-D convolutions (a video model's patch embedding), on channels-last-3d activations or
    contiguous ones."""

    def __init__(self, channels_last: bool):
        super().__init__()
        torch.manual_seed(0)
        self.channels_last = channels_last
        self.c1 = nn.Conv3d(3, 4, 3, padding=1)
        self.c2 = nn.Conv3d(4, 3, 3, padding=1)

    def forward(self, x, t):
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        return self.c2(torch.relu(self.c1(x)) * t.view(-1, 1, 1, 1, 1).float())


@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last_3d", "contiguous"])
def test_one_row_regrouped_from_3d_convolutions_under_inductor(channels_last):
    """A batch-1 update call whose row Retain kept in a batch-4 call: its backward would run
    the kept graph's, compiled for a symbolic batch, at a batch of 1, where torch's 3-D
    convolution returns its gradients contiguous for channels-last-3d inputs (at any other
    batch: channels-last-3d), and Inductor's compiled backward asserted the format it compiled
    for ("expected size 4==4, stride 64==1"; a review found it). That call is recomputed, with
    the reason; on contiguous activations (a format that does not change) it is served. The
    three-row call is served; gradients are eager autograd's."""
    plan = ([2, 0, 3], [1])

    def loop(model, step):
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(4, 3, 4, 4, 4, generator=g) for _ in range(2)]
        with _phase(step, "rollout", train=2), torch.no_grad():
            for k in range(2):
                (step or model)(xs[k], torch.full((4,), k))
        model.zero_grad()
        with _phase(step, "update"):
            for rows in plan:
                for k in range(2):
                    r = torch.tensor(rows)
                    out = (step or model)(xs[k][r], torch.full((len(rows),), k))
                    (out.square().sum((1, 2, 3, 4)) * torch.arange(1.0, len(rows) + 1)).sum() \
                        .backward()
        return _grads(model)

    want = loop(Conv3dPolicy(channels_last), None)
    model = Conv3dPolicy(channels_last)
    step = leancompile.lean_compile(model, backend="inductor", schedule="retain")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReuseWarning)
        got = loop(model, step)
    if channels_last:
        assert step.stats.reused_calls == 2, step.stats.summary()
        [(reason, n)] = step.stats.recomputed.items()
        assert n == 2 and "3-D convolution" in reason, step.stats.recomputed
    else:
        assert step.stats.reused_calls == 4 and not step.stats.recomputed, step.stats.summary()
    assert _rel(got, want) <= 1e-5, _rel(got, want)


def _passthrough_loop(model, fn, step, *, autocast=False, hook_between=False):
    """``_flow_grpo_loop``'s rollout and mixed update batches with what users add: bf16
    autocast around both phases, a forward hook registered between them, the served log-prob
    edited in place, its loss backpropagated twice (``retain_graph=True`` first)."""
    g = torch.Generator().manual_seed(3)
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast \
        else contextlib.nullcontext
    xs, cond, lps = [], torch.randn(8, C, generator=g), []
    with _phase(step, "rollout", train=3, trajectory_steps=T), torch.no_grad(), cast():
        for b in range(2):
            traj, lp = [torch.randn(4, D, generator=g)], []
            for k in range(T):
                sample, log_prob, _ = fn(traj[-1], torch.full((4,), k), cond[4 * b:4 * b + 4],
                                         noise=torch.randn(4, D, generator=g))
                traj.append(sample.float())
                lp.append(log_prob.float())
            xs.append(torch.stack(traj, 1))
            lps.append(torch.stack(lp, 1))
    xs, lps = torch.cat(xs), torch.cat(lps)
    handle = model.out.register_forward_hook(lambda m, a, o: o * 1.5) if hook_between else None
    adv = torch.linspace(-1, 1, 8)
    with _phase(step, "update"), cast():
        for rows, k in MIXED:
            rows = torch.tensor(rows)
            _, log_prob, _ = fn(xs[rows, k], torch.full((4,), k), cond[rows],
                                prev_sample=xs[rows, k + 1])
            log_prob = log_prob.float()
            log_prob.mul_(1.0)
            loss = -(adv[rows] * torch.exp(log_prob - lps[rows, k])).mean()
            loss.backward(retain_graph=True)
            loss.backward()
    if handle is not None:
        handle.remove()
    return _grads(model)


def test_a_passed_through_sample_under_bf16_a_hook_and_two_backwards():
    """The pass-through step (DanceGRPO's spelling) as a user's loop runs it under Inductor:
    with bf16 autocast Retain serves every call and equals recompute bitwise; with a hook
    registered between the phases nothing is reused (another graph, counted) and the
    gradients are eager autograd's, the hook included."""
    grads = {}
    for schedule in ("recompute", "retain"):
        model = Policy(seed=1)
        step = leancompile.lean_compile(_flow_grpo_step(model), backend="inductor",
                                        schedule=schedule, sample_output=0,
                                        sample_arg="prev_sample")
        grads[schedule] = _passthrough_loop(model, step, step, autocast=True)
    assert step.stats.reused_calls == len(MIXED), step.stats.summary()
    assert torch.equal(grads["retain"], grads["recompute"])
    reference = Policy(seed=1)
    want = _passthrough_loop(reference, _flow_grpo_step(reference), None, hook_between=True)
    model = Policy(seed=1)
    step = leancompile.lean_compile(_flow_grpo_step(model), backend="inductor", schedule="retain",
                                    sample_output=0, sample_arg="prev_sample")
    got = _passthrough_loop(model, step, step, hook_between=True)
    assert step.stats.reused_calls == 0 and step.stats.forwards_run == len(MIXED)
    assert "another graph" in next(iter(step.stats.recomputed)), step.stats.summary()
    assert _rel(got, want) <= 1e-5, _rel(got, want)


class ListedExperts(nn.Module):
    """Experts kept in a plain list, the module tree told of them by ``named_modules`` (as some
    mixture-of-experts holders do): a hook on an expert is one the call runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 4)
        self.experts = [nn.Linear(4, 4), nn.Linear(4, 4)]
        for i, expert in enumerate(self.experts):  # (trained, but not submodules)
            for name, p in expert.named_parameters():
                self.register_parameter(f"expert{i}_{name}", p)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield from super().named_modules(memo, prefix, remove_duplicate)
        for i, expert in enumerate(self.experts):
            yield f"{prefix}.experts.{i}" if prefix else f"experts.{i}", expert

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.experts[0](h) + self.experts[1](h)


def _listed_loop(model, step):
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    with _phase(step, "rollout", train=1), torch.no_grad():
        (step or model)(x)
    handle = model.experts[1].register_forward_hook(lambda m, a, o: o * 3.0)
    model.zero_grad()
    with _phase(step, "update"):
        (step or model)(x).square().sum().backward()
    handle.remove()
    return _grads(model)


def test_a_hook_added_between_the_phases_on_a_module_its_tree_lists_outside_its_children():
    """The step's look at its modules' hooks at each phase entry walks what the module says it
    holds (``named_modules``), not only its children: a hook added on an expert kept in a list
    between the rollout and the update makes the update run the graph with the hook (the kept
    call, traced without it, is not reused). A review found the faster walk had looked at the
    children alone."""
    want = _listed_loop(ListedExperts(), None)
    model = ListedExperts()
    step = leancompile.lean_compile(model, backend="aot_eager", schedule="retain")
    got = _listed_loop(model, step)
    assert step.stats.reused_calls == 0, step.stats.summary()
    assert _rel(got, want) <= 1e-6, _rel(got, want)


def test_a_module_without_its_own_hook_dicts_is_wrapped():
    """A module whose hook dicts are not in its instance dict (one restored without
    ``Module.__init__``, a dict on its class) is wrapped and run: the hook walk reads them as
    attributes."""

    class NoOwnHooks(nn.Linear):
        _backward_pre_hooks = {}

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    odd = NoOwnHooks(2, 2)
    del odd.__dict__["_backward_pre_hooks"]
    model.append(odd)
    step = leancompile.lean_compile(model, backend="aot_eager", schedule="recompute")
    x = torch.randn(3, 4)
    with step.rollout(train=1), torch.no_grad():
        step(x)
    with step.update():
        step(x).sum().backward()
    want = copy.deepcopy(model)
    want.zero_grad()
    want(x).sum().backward()
    assert _rel(_grads(model), _grads(want)) <= 1e-6, _rel(_grads(model), _grads(want))


class Tokens(nn.Module):
    """A step over ``[B, L, D]`` tokens: its linear layers flatten to ``[B*L, D]``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.qkv, self.out = nn.Linear(D, D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.temb = nn.Embedding(T, D)

    def forward(self, x, t):
        b, length, d = x.shape
        h = self.inp(x) + self.temb(t)[:, None]
        q, k, v = (z.reshape(b, length, 2, d // 2).transpose(1, 2)
                   for z in self.qkv(h).chunk(3, -1))
        return self.out(h + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(
            b, length, d))


def _tokens_log_prob(model):
    def log_prob(x, t, target):
        return -(target - model(x, t)).square().mean((1, 2))
    return log_prob


def _tokens_loop(model, step):
    """Two epochs at 4 then 6 tokens (another resolution), each a rollout, an update of
    shuffled rows (a log-prob per row) and an SGD step; the gradients of each epoch."""
    fn = _tokens_log_prob(model) if step is None else step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for length in (4, 6):
        g = torch.Generator().manual_seed(length)
        xs = [torch.randn(4, length, D, generator=g)]
        targets = [torch.randn(4, length, D, generator=g) for _ in range(T)]
        adv = torch.randn(4, generator=g)
        with _phase(step, "rollout", train=3), torch.no_grad():
            for k in range(T):
                fn(xs[-1], torch.full((4,), k), targets[k])
                xs.append(xs[-1] + 0.1 * targets[k])
        opt.zero_grad(set_to_none=True)
        with _phase(step, "update"):
            for rows in SHUFFLED:
                for k in range(3):
                    lp = fn(xs[k][rows], torch.full((2,), k), targets[k][rows])
                    (-(adv[rows] * lp).mean()).backward()
        out.append(_grads(model))
        opt.step()
    return out


@pytest.mark.parametrize("schedule,mechanism", [("retain", "gathered rows"),
                                                ("reweight", "per-row gradients")])
def test_dynamic_shapes_reuse_the_rollout(schedule, mechanism):
    """``lean_compile(..., dynamic=True)`` (one graph for every resolution): a ``[B*L, D]``
    row block has ``L`` rows per sample with ``L`` a symbol, which the row analysis took for
    rows of samples meeting ("dim 0 is s0*s1, not a multiple of the batch size"): no update
    call was served, at any size. Each kept tensor's rows per sample are now read off its
    shape; two token counts through the one graph, Inductor."""
    want = _tokens_loop(Tokens(), None)
    model = Tokens()
    step = leancompile.lean_compile(_tokens_log_prob(model), backend="inductor",
                                    schedule=schedule, dynamic=True)
    got = _tokens_loop(model, step)
    assert step.stats.mechanisms == {mechanism: 12}, step.stats.summary()
    for epoch, (a, b) in enumerate(zip(got, want)):
        assert _rel(a, b) <= 1e-5, (epoch, _rel(a, b))


class PositionsFirst(nn.Module):
    """A step whose first argument is a ``[L, 3]`` position table (no batch), then the
    ``[B, L, D]`` latents and the ``[B]`` timesteps, as FLUX's ``img_ids`` passed first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos, self.inp, self.out = nn.Linear(3, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, ids, x, t):
        return self.out(torch.tanh(self.inp(x) + self.pos(ids)[None] + t[:, None, None]))


def _positions_loop(model, step, length):
    fn = (lambda ids, x, t, target: -(target - model(ids, x, t)).square().mean((1, 2))) \
        if step is None else step
    g = torch.Generator().manual_seed(0)
    ids = torch.randn(length, 3, generator=g)
    xs = [torch.randn(4, length, D, generator=g)]
    targets = [torch.randn(4, length, D, generator=g) for _ in range(3)]
    adv = torch.randn(4, generator=g)
    with _phase(step, "rollout", train=3), torch.no_grad():
        for k in range(3):
            fn(ids, xs[-1], torch.full((4,), float(k)), targets[k])
            xs.append(xs[-1] + 0.1 * targets[k])
    with _phase(step, "update"):
        for rows in SHUFFLED:
            for k in range(3):
                lp = fn(ids, xs[k][rows], torch.full((2,), float(k)), targets[k][rows])
                (-(adv[rows] * lp).mean()).backward()
    return _grads(model)


def test_a_same_sized_table_beside_the_batch_under_dynamic_shapes():
    """``dynamic=True``: a ``[4, 3]`` position table passed first, beside a batch of 4, has a
    size symbol of its own; the batch symbol is the one of that size most tensor arguments
    share (a probe saw the table's taken, and no row regrouped; which symbol Dynamo numbers
    first varies, so this passed before too). Every update call served, exact."""
    want = _positions_loop(PositionsFirst(), None, 4)
    for schedule, mechanism in (("retain", "gathered rows"), ("reweight", "per-row gradients")):
        model = PositionsFirst()
        step = leancompile.lean_compile(
            lambda ids, x, t, target: -(target - model(ids, x, t)).square().mean((1, 2)),
            backend="aot_eager", schedule=schedule, dynamic=True)
        got = _positions_loop(model, step, 4)
        assert step.stats.mechanisms == {mechanism: 6}, step.stats.summary()
        assert _rel(got, want) <= 1e-5, (schedule, _rel(got, want))
