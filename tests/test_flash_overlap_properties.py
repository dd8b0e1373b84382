"""Property-based tests of the FlashOverlap rewrite (hypothesis).

The contract: for any program the strategy draws, the program compiled with the pass
(``overlap="flash"`` or the ``"slice"`` baseline) computes what the same program compiled
without it (``leancompile.backend(compiler=...)``, no ``overlap``) computes, and every collective
is reported rewritten or skipped with a reason.
Precisely, on every rank of the group, for every call:

- no exception, from the pass or at runtime (the suite sets ``LEANCOMPILE_ON_ERROR=raise``, so
  a rewrite that fails raises here instead of being skipped; a site skipped because matching or
  rewriting raised, ``Site.local == "error"``, fails too);
- every collective of every graph the pass saw is in its report, rewritten or skipped with a
  reason, and the ranks of the group agree on which sites were rewritten;
- outputs and gradients equal the plain compile's: bitwise where the summation order is
  unchanged (the output of an all-gather feeding a matmul with a contiguous ``(K, N)`` weight, in
  float32 under ``aot_eager``: the schedule splits rows only; and every tensor of a graph where
  nothing was rewritten); else within 1e-5 of each tensor's scale in float32; in bfloat16 the
  pass's error against a float32 eager run may not exceed twice the plain compile's error, or
  two bf16 rounding steps of the tensor's scale (the convention of ``_bf16_close`` in
  ``test_flash_overlap_safety.py``).

The programs: on a group of 2, 3 or 4 ranks, an all-gather feeding a linear layer, a linear
layer feeding a reduce-scatter, or both (the sequence-parallel MLP ``gather -> linear -> gelu ->
linear -> reduce-scatter``), over 2-D ``[rows, d]`` or 3-D ``[b, s, d]`` activations, collective
dim 0 or 1, per-rank sizes 1..8 (often not divisible by ``world_size * chunks_per_rank``, or
``chunks``: those sites must be skipped or rewritten correctly), the weight used as ``x @ w``,
``x @ w.t()`` or ``F.linear``, with or without bias, float32 or bfloat16, forward only (an
inference graph) or forward and backward, static, automatic-dynamic, ``dynamic=True`` or
``mark_dynamic``, one call or two calls of different sizes, ``aot_eager`` (and, in the local
profile, Inductor for one example in eight).

Design. Hypothesis runs in the pytest process, so that it can shrink a failing example; the
distributed work runs in a pool of 4 gloo worker processes spawned once per module
(``pool``). Every worker builds the subgroups [0, 1], [0, 1, 2] and [0, 1, 2, 3]. The parent
sends each example (a small dict) to every worker; workers outside the example's group reply
"idle", the others compile the program with and without the pass, run both (and a float32 eager
reference for bf16), and reply with the per-tensor differences and the pass's report. Every
reply is waited for with a timeout (a hang fails the example instead of blocking the suite), and
after an error, a timeout or a dead worker the pool is replaced, as the P2P state of its ranks
can no longer be trusted.

Profiles, chosen by ``LEANCOMPILE_HYPOTHESIS_PROFILE``:

- ``ci`` (the default): derandomized (the same examples on every run), 35 examples, no example
  database; about a minute on a 2-core machine.
- ``local``: random, 300 examples (about 15 minutes), Inductor in one example in eight,
  failing examples saved in hypothesis's database (``.hypothesis/``) and replayed first on the
  next run. ``LEANCOMPILE_HYPOTHESIS_PROFILE=local pytest
  tests/test_flash_overlap_properties.py --hypothesis-show-statistics`` also prints how the
  examples spread over kinds, world sizes and outcomes.

Cases hypothesis found become ``@example`` rows of the property (``FOUND_*``), so that every
profile replays them.
"""

import os
import queue
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import leancompile
import collector
from compat import all_gather_single, reduce_scatter_single

AG, RS = "all_gather+mm", "mm+reduce_scatter"
POOL_SIZE = 4
GROUP_SIZES = (2, 3, 4)
REPLY_TIMEOUT_S = 120
"""How long the parent waits for one example's replies (the gloo timeout is shorter)."""

settings.register_profile(
    "ci", max_examples=35, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile(
    "local", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    print_blob=True)
PROFILE_NAME = os.environ.get("LEANCOMPILE_HYPOTHESIS_PROFILE", "ci")
PROFILE = settings.get_profile(PROFILE_NAME)
# An Inductor example takes 5 to 60 s here (4 workers on 2 cores, C++ kernels to build): one
# example in eight locally, none in CI (the other FlashOverlap tests compile with Inductor).
COMPILERS = {"ci": ("aot_eager",), "local": ("aot_eager",) * 7 + ("inductor",)}[PROFILE_NAME]


# ---------------------------------------------------------------------------------------------
# Examples


@st.composite
def examples(draw, compilers=("aot_eager",)) -> dict:
    """One program, its sizes and the pass options, as a picklable dict.

    Each field is drawn from a strategy that no other field uses (``ndim`` and ``dim``, ``d``
    and ``hidden`` as pairs): hypothesis's generator also tries copying a value between draws of
    one strategy, and with a budget of a few dozen examples such near-copies would be most of
    them.
    """
    world = draw(st.sampled_from(GROUP_SIZES))
    kind = draw(st.sampled_from(("gather", "scatter", "mlp")))
    ndim, dim = draw(st.sampled_from(((2, 0), (2, 1), (3, 0), (3, 1))))
    mode = draw(st.sampled_from(("static", "auto", "dynamic", "mark")))
    # mark_dynamic raises when the program specializes the marked size, which reduce-scattering
    # a size of 2 to 1 per rank does.
    smallest = 2 if mode == "mark" else 1
    shards = [draw(st.sampled_from(range(smallest, 9)))]
    if draw(st.sampled_from(range(1, 3))) == 2:  # a second call, of the same or another size
        shards.append(draw(st.integers(smallest, 8)))
    d, hidden = draw(st.sampled_from([(d, h) for d in (4, 8, 12, 16) for h in (4, 8, 12, 16)]))
    overlap = draw(st.sampled_from(("flash", "flash", "flash", "slice")))
    if overlap == "slice":
        options = {"overlap": overlap, "chunks": draw(st.sampled_from(range(1, 4)))}
    else:
        options = {"overlap": overlap, "chunks_per_rank": draw(st.sampled_from(range(1, 4))),
                   "variant": draw(st.sampled_from(("ring", "direct")))}
    return {
        "world": world, "kind": kind, "ndim": ndim, "dim": dim, "shards": shards,
        "other": draw(st.sampled_from(range(1, 5))), "d": d, "hidden": hidden,
        "weight": draw(st.sampled_from(("kn", "t", "linear"))),
        "bias": draw(st.booleans()), "backward": draw(st.sampled_from((False, True))),
        "dtype": draw(st.sampled_from(("float32", "bfloat16"))), "mode": mode,
        "compiler": draw(st.sampled_from(compilers)),
        "options": options, "seed": draw(st.sampled_from(range(2 ** 16))),
    }


# ---------------------------------------------------------------------------------------------
# The worker side: build, compile, run, compare


def _linear(x, w, b, weight):
    """``x`` times ``w`` (plus ``b``), spelled as the example says."""
    if weight == "linear":
        return F.linear(x, w, b)
    y = x @ (w.t() if weight == "t" else w)
    return y if b is None else y + b


def _program(ex, group):
    """``fn(x, *params)``: gather on ``ex["dim"]``, linear, (gelu, linear,) reduce-scatter."""
    gather, scatter = ex["kind"] in ("gather", "mlp"), ex["kind"] in ("scatter", "mlp")

    def fn(x, *params):
        params = iter(params)

        def linear(t):
            w = next(params)
            return _linear(t, w, next(params) if ex["bias"] else None, ex["weight"])

        if gather:
            x = linear(all_gather_single(x, ex["dim"], group))
        if ex["kind"] == "mlp":
            x = F.gelu(x)
        if scatter:
            x = reduce_scatter_single(linear(x), "sum", ex["dim"], group)
        return x

    return fn


def _shapes(ex, shard):
    """(input shape, parameter shapes) for a per-rank size ``shard`` along the collective dim.

    The gathered (or reduced) activation is ``[rows, d]`` or ``[b, s, d]`` with ``world * shard``
    on the collective dim; when that is the last dim, it is also the features of the weights.
    """
    full = [ex["other"], ex["d"]] if ex["ndim"] == 2 else [ex["other"], ex["other"], ex["d"]]
    full[ex["dim"]] = ex["world"] * shard
    features, hidden = full[-1], ex["hidden"]
    x = full[:-1] + [hidden] if ex["kind"] == "scatter" else list(full)
    if ex["kind"] != "scatter":
        x[ex["dim"]] = shard

    def weight(k, n):
        return [(k, n) if ex["weight"] == "kn" else (n, k)] + ([(n,)] if ex["bias"] else [])

    params = []
    if ex["kind"] != "scatter":
        params += weight(features, hidden)
    if ex["kind"] != "gather":
        params += weight(hidden, features)
    return x, params


def _inputs(ex, rank, shard, call):
    """Float32 (input, params): the weights the same on every rank, the input this rank's
    own."""
    x_shape, param_shapes = _shapes(ex, shard)
    dtype = getattr(torch, ex["dtype"])  # values the example's dtype holds exactly
    torch.manual_seed(ex["seed"] * 16 + call)
    params = [torch.randn(s).to(dtype).float() for s in param_shapes]
    torch.manual_seed(ex["seed"] * 16 + call + 1000 * (rank + 1))
    return torch.randn(x_shape).to(dtype).float(), params


def _run(fn, x, params, ex, dtype, *, mark_dim=None):
    """Output and gradients (input, then params) of one call, as float32 tensors."""
    x = x.to(dtype, copy=True).requires_grad_(ex["backward"])
    params = [p.to(dtype, copy=True).requires_grad_(ex["backward"]) for p in params]
    if mark_dim is not None:
        torch._dynamo.mark_dynamic(x, mark_dim)
    y = fn(x, *params)
    if not ex["backward"]:
        return [y.float()]
    torch.manual_seed(ex["seed"] + 7)
    y.backward(torch.randn(y.shape).to(getattr(torch, ex["dtype"])).to(dtype))
    return [t.detach().float() for t in (y, x.grad, *(p.grad for p in params))]


class _Recorder:
    """The pass's backend, keeping the report of every compile (recompiles included)."""

    def __init__(self, **options):
        self.backend = leancompile.backend(**options)
        self.reports = []

    def __call__(self, gm, example_inputs):
        compiled = self.backend(gm, example_inputs)
        self.reports.append(leancompile.last_report())
        return compiled

    def graphs(self) -> list[dict]:
        """Per graph the pass saw: its phase, how many collectives it had, and the pass's
        rewritten and skipped sites (kind, node, reason, local)."""
        out = []
        for report in self.reports:
            assert not report.cached, "the compile caches are off in the workers"
            for record in report.graphs:
                [result] = [p for p in record.passes if p.name == "flash_overlap"]
                out.append({
                    "phase": record.phase,
                    "collectives": sum(n for op, n in record.op_counts_before.items()
                                       if op.startswith("_c10d_functional.")
                                       and "wait_tensor" not in op),
                    "rewritten": [(s.kind, s.node) for s in result.rewritten],
                    "skipped": [(s.kind, s.node, s.reason, s.local) for s in result.skipped]})
        return out


def _compare(flash, plain, reference=None) -> list[dict]:
    """Per tensor: bitwise equality, the max abs difference relative to the tensor's scale (at
    least 1), and with a float32 ``reference`` both compiles' errors against it."""
    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()

    out = []
    for i, (f, p) in enumerate(zip(flash, plain)):
        diff = {"bitwise": torch.equal(f, p), "rel": rel(f, p)}
        if reference is not None:
            diff.update(flash_err=rel(f, reference[i]), plain_err=rel(p, reference[i]))
        out.append(diff)
    return out


def run_example(ex, rank, group) -> dict:
    """Compile ``ex``'s program with and without the pass and run both on every call."""
    torch._dynamo.reset()
    fn = _program(ex, group)
    dtype = getattr(torch, ex["dtype"])
    compile_kw = {"dynamic": {"static": False, "dynamic": True}.get(ex["mode"])}
    flash = _Recorder(compiler=ex["compiler"], **ex["options"])
    compiled = torch.compile(fn, backend=flash, **compile_kw)
    plain = torch.compile(fn, backend=leancompile.backend(compiler=ex["compiler"]),
                          **compile_kw)
    mark_dim = None
    if ex["mode"] == "mark":  # the collective dim, or the rows when it is the weights' dim
        mark_dim = ex["dim"] if ex["dim"] < ex["ndim"] - 1 else 0
    calls = []
    for call, shard in enumerate(ex["shards"]):
        x, params = _inputs(ex, rank, shard, call)
        reference = _run(fn, x, params, ex, torch.float32) if dtype != torch.float32 else None
        got = _run(compiled, x, params, ex, dtype, mark_dim=mark_dim)
        want = _run(plain, x, params, ex, dtype, mark_dim=mark_dim)
        calls.append(_compare(got, want, reference))
    return {"calls": calls, "graphs": flash.graphs()}


def _worker(rank, init_file, inbox, outbox):
    """One process of the pool: joins the group of ``POOL_SIZE`` and its subgroups, then answers
    each example from ``inbox`` on ``outbox`` until it receives None."""
    timeout = timedelta(seconds=REPLY_TIMEOUT_S // 2)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=POOL_SIZE, timeout=timeout)
    torch.set_num_threads(1)
    collector.settle()
    torch._inductor.config.compile_threads = 1  # no pool of compile processes per worker
    # The pass must run on every compile: no graph served from Inductor's caches.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    groups = {n: dist.new_group(list(range(n)), timeout=timeout) for n in GROUP_SIZES}
    outbox.put("ready")
    while (ex := inbox.get()) is not None:
        if rank >= ex["world"]:
            outbox.put("idle")
            continue
        try:
            outbox.put(run_example(ex, rank, groups[ex["world"]]))
        except Exception:  # noqa: BLE001 - the parent reports it with the example
            outbox.put({"error": traceback.format_exc()})
    dist.destroy_process_group()
    os._exit(0)  # the parent has every reply; the interpreter's teardown takes seconds


# ---------------------------------------------------------------------------------------------
# The parent side: the pool


class WorkerPool:
    """``POOL_SIZE`` gloo workers in one process group; ``run(ex)`` returns their replies."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.starts = 0
        self.procs = []
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.starts += 1
        init_file = self.directory / f"init{self.starts}"
        self.inboxes = [ctx.Queue() for _ in range(POOL_SIZE)]
        self.outboxes = [ctx.Queue() for _ in range(POOL_SIZE)]
        self.procs = [ctx.Process(target=_worker, args=(r, str(init_file), self.inboxes[r],
                                                        self.outboxes[r]), daemon=True)
                      for r in range(POOL_SIZE)]
        for proc in self.procs:
            proc.start()
        replies = self._replies(time.monotonic() + REPLY_TIMEOUT_S)
        if replies != ["ready"] * POOL_SIZE:
            self.close()
            raise RuntimeError(f"the worker pool did not start: {replies}")

    def run(self, ex: dict) -> list:
        """Every worker's reply to ``ex`` (a result dict, "idle", or ``{"error": text}``); after
        an error, a timeout or a dead worker the pool is replaced."""
        for inbox in self.inboxes:
            inbox.put(ex)
        replies = self._replies(time.monotonic() + REPLY_TIMEOUT_S)
        if any(isinstance(r, dict) and "error" in r for r in replies):
            self.close()
            self.start()
        return replies

    def _replies(self, deadline: float) -> list:
        """One reply per worker, or an error entry for a worker that died or missed the
        deadline."""
        replies = []
        for rank, (proc, outbox) in enumerate(zip(self.procs, self.outboxes)):
            while True:
                try:
                    replies.append(outbox.get(timeout=1.0))
                    break
                except queue.Empty:
                    if not proc.is_alive():
                        replies.append({"error": f"worker {rank} died (exit code "
                                                 f"{proc.exitcode})"})
                        break
                    if time.monotonic() > deadline:
                        replies.append({"error": f"worker {rank} sent no reply within "
                                                 f"{REPLY_TIMEOUT_S} s (a hang?)"})
                        break
        return replies

    def close(self) -> None:
        for proc, inbox in zip(self.procs, self.inboxes):
            if proc.is_alive():
                inbox.put(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    workers = WorkerPool(tmp_path_factory.mktemp("flash_properties"))
    yield workers
    workers.close()


# ---------------------------------------------------------------------------------------------
# The property


def _bf16_close(diff, slack=2.0, floor=2 ** -6) -> bool:
    """bf16: the pass's error against the float32 reference is at most ``slack`` times the plain
    compile's, or two bf16 rounding steps of the tensor's scale."""
    return diff["flash_err"] <= max(slack * diff["plain_err"], floor)


def check(ex: dict, replies: list) -> None:
    """The contract (module docstring) on every rank of ``ex``'s group."""
    group = replies[:ex["world"]]
    assert replies[ex["world"]:] == ["idle"] * (POOL_SIZE - ex["world"]), replies
    for rank, reply in enumerate(group):
        assert "error" not in reply, f"rank {rank} of {ex}:\n{reply['error']}"
    for rank, reply in enumerate(group):
        where = f"rank {rank} of {ex}"
        rewrote = False
        for graph in reply["graphs"]:
            rewritten, skipped = graph["rewritten"], graph["skipped"]
            assert len(rewritten) + len(skipped) == graph["collectives"], (where, graph)
            assert all(kind in (AG, RS) for kind, _ in rewritten), (where, graph)
            for *_, reason, local in skipped:
                assert reason and local != "error", (where, graph)
            rewrote = rewrote or bool(rewritten)
        # Row slices of an all-gather's matmul add in the same order as the whole matmul when
        # the weight is a contiguous (K, N) matrix. With a transposed weight (x @ w.t(),
        # F.linear) MKL picks its kernel by the number of rows: slices of 1 row, or of 2 and 4
        # rows when K <= 8, round differently from the whole (FOUND_TRANSPOSED_WEIGHT). A graph
        # left as it was (probes copy their input) runs the same ops as the plain one.
        exact_forward = (ex["kind"] == "gather" and ex["weight"] == "kn"
                         and ex["dtype"] == "float32" and ex["compiler"] == "aot_eager")
        exact_all = not rewrote and ex["compiler"] == "aot_eager"
        for call, diffs in enumerate(reply["calls"]):
            for i, diff in enumerate(diffs):
                what = f"{where}, call {call}, tensor {i} (output, grad input, grad params)"
                if exact_all or (exact_forward and i == 0):
                    assert diff["bitwise"], (what, diff, reply["graphs"])
                elif ex["dtype"] == "float32":
                    assert diff["rel"] <= 1e-5, (what, diff, reply["graphs"])
                else:
                    assert _bf16_close(diff), (what, diff, reply["graphs"])
    decisions = [[(g["phase"], g["rewritten"]) for g in reply["graphs"]] for reply in group]
    assert all(d == decisions[0] for d in decisions), (ex, decisions)


def _record_events(ex: dict, replies: list) -> None:
    """What ``--hypothesis-show-statistics`` shows: the spread of the examples."""
    event(f"world {ex['world']}, {ex['kind']}")
    event(ex["compiler"])
    graphs = replies[0]["graphs"]
    rewritten = any(g["rewritten"] for g in graphs)
    skipped = any(g["skipped"] for g in graphs)
    event({(True, False): "all sites rewritten", (True, True): "some sites rewritten",
           (False, True): "every site skipped"}.get((rewritten, skipped), "no site"))


# Found by the local profile: one row per rank, gathered and multiplied by a transposed weight,
# is 3e-8 off the plain compile, not bitwise equal to it (see ``check``).
FOUND_TRANSPOSED_WEIGHT = {
    "world": 2, "kind": "gather", "ndim": 2, "dim": 0, "shards": [1], "other": 1, "d": 4,
    "hidden": 4, "weight": "t", "bias": False, "backward": False, "dtype": "float32",
    "mode": "static", "compiler": "aot_eager",
    "options": {"overlap": "flash", "chunks_per_rank": 1, "variant": "ring"}, "seed": 0}


@pytest.mark.timeout(PROFILE.max_examples * 20)  # 1-4 s an example, more to shrink a failure
@PROFILE
@given(ex=examples(COMPILERS))
@example(ex=FOUND_TRANSPOSED_WEIGHT)
def test_rewrite_equals_the_original_or_skips_with_a_reason(pool, ex):
    replies = pool.run(ex)
    check(ex, replies)
    _record_events(ex, replies)


# Found by the local profile: ``mark_dynamic`` on the rows of ``x @ w + b`` fed to a
# reduce-scatter, with as many rows (4) as the bias has elements. The matcher compares the shapes
# of the add's operands with ``==`` (the sum-of-matmuls check in passes/flash/reduce_scatter_match.py): ``s0 == 4``
# on SymInts adds the guard ``Eq(s0, 4)``, which specializes the marked size, and Dynamo raises
# ConstraintViolationError after the backend returns (the plain compile runs).
FOUND_MARKED_ROWS_SPECIALIZED = {
    "world": 2, "kind": "scatter", "ndim": 2, "dim": 0, "shards": [2], "other": 1, "d": 4,
    "hidden": 4, "weight": "kn", "bias": True, "backward": False, "dtype": "float32",
    "mode": "mark", "compiler": "aot_eager",
    "options": {"overlap": "flash", "chunks_per_rank": 1, "variant": "ring"}, "seed": 0}


def test_found_marked_rows_equal_to_the_bias_length_stay_dynamic(pool):
    """Found by the local profile: ``_sum_of_matmuls`` compared SymInt shapes with ``==``
    (``(s0, 4) == (4,)`` compares ``s0 == 4``), which specialized a marked-dynamic row count
    equal to the bias length: ``ConstraintViolationError`` from Dynamo after the backend
    returned, out of reach of ``on_error``. Shapes are now compared without guards."""
    check(FOUND_MARKED_ROWS_SPECIALIZED, pool.run(FOUND_MARKED_ROWS_SPECIALIZED))
