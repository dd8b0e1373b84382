"""install(): chains a previously installed pass, restores it, and its uuid keys the cache."""

import os

import pytest
import torch
import torch.distributed as dist
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import leancompile
from leancompile.compiler import LeanGraphPass
from leancompile.options import CompileOptions
from models import assert_same_training_step, mlp
from ranks import spawn


class CountingPass(CustomGraphPass):
    """A user's own post-grad pass: counts the graphs it sees and the mm-like ops in them."""

    def __init__(self, uuid="user-pass-v1"):
        self.graphs = []
        self._uuid = uuid

    def __call__(self, graph):
        self.graphs.append(sum(n.op == "call_function" for n in graph.nodes))

    def uuid(self):
        return self._uuid


@pytest.fixture
def clean_inductor_pass():
    saved = inductor_config.post_grad_custom_pre_pass
    yield
    inductor_config.post_grad_custom_pre_pass = saved


def test_install_context_chains_and_restores(clean_inductor_pass, no_compile_cache):
    user_pass = CountingPass()
    inductor_config.post_grad_custom_pre_pass = user_pass
    model = mlp()
    x = torch.randn(4, 16)
    with leancompile.install() as installed:
        assert inductor_config.post_grad_custom_pre_pass is installed.graph_pass
        compiled = torch.compile(model)  # the user's own torch.compile call, Inductor
        assert_same_training_step(model, model, compiled, (x,))
        assert len(user_pass.graphs) == 2  # the user's pass still ran, on forward and backward
        report = leancompile.last_report()
        assert report.phases == ["forward", "backward"]
        assert report.options["compiler"] == "inductor"
    assert inductor_config.post_grad_custom_pre_pass is user_pass


def test_install_chains_a_list_of_passes(clean_inductor_pass, no_compile_cache):
    """Inductor takes a list of custom passes: installed over one, ours runs each of them
    first and its cache key covers theirs (one without a uuid: no key, as Inductor does)."""
    first, second = CountingPass("a-v1"), CountingPass("b-v1")
    inductor_config.post_grad_custom_pre_pass = [first, second]
    model = mlp()
    x = torch.randn(4, 16)
    with leancompile.install() as installed:
        assert_same_training_step(model, model, torch.compile(model), (x,))
        assert len(first.graphs) == len(second.graphs) == 2
        key = installed.graph_pass.uuid()
        second._uuid = "b-v2"
        assert key is not None and installed.graph_pass.uuid() != key
        second._uuid = None
        assert installed.graph_pass.uuid() is None
    assert inductor_config.post_grad_custom_pre_pass == [first, second]


def test_install_plain_call_and_uninstall(clean_inductor_pass, no_compile_cache):
    inductor_config.post_grad_custom_pre_pass = None
    installed = leancompile.install(disable=("canonicalize",))
    try:
        assert isinstance(inductor_config.post_grad_custom_pre_pass, LeanGraphPass)
        model = mlp()
        x = torch.randn(4, 16)
        assert_same_training_step(model, model, torch.compile(model), (x,))
        assert leancompile.last_report().graphs[0].passes[0].disabled
    finally:
        installed.uninstall()
    assert inductor_config.post_grad_custom_pre_pass is None
    installed.uninstall()  # a second uninstall is a no-op


def _two_modules():
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 4)
    b = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return a, b


def _dims(record) -> set[int]:
    """Every tensor dimension in a graph record's final code."""
    import re

    return {int(d) for shape in re.findall(r"f32\[([\d, ]+)\]", record.after)
            for d in shape.split(",") if d.strip()}


def _attribution(compile_a, compile_b):
    a, b = _two_modules()
    ca, cb = compile_a(a), compile_b(b)
    x = torch.randn(2, 4)
    ya = ca(x)
    report_a = leancompile.last_report()
    yb = cb(x)
    report_b = leancompile.last_report()
    # Both forwards first, then both backwards: each backward compiles lazily, after the other
    # module's forward.
    ya.sum().backward()
    yb.sum().backward()
    return report_a, report_b


def _check_attribution(report_a, report_b):
    assert report_a is not report_b
    assert report_a.phases == ["forward", "backward"], report_a.phases
    assert report_b.phases == ["forward", "backward"], report_b.phases
    # a's graphs only hold 2x4 and 4x4 tensors; b's backward has b's 8-wide hidden layer.
    for record in report_a.graphs:
        assert 8 not in _dims(record), (record.phase, _dims(record))
    assert 8 in _dims(report_b.graph("backward"))


def test_install_attributes_each_backward_to_its_own_forward(clean_inductor_pass,
                                                             no_compile_cache):
    with leancompile.install() as installed:
        report_a, report_b = _attribution(torch.compile, torch.compile)
        _check_attribution(report_a, report_b)
        assert installed.reports == [report_a, report_b]


def test_backend_attributes_each_backward_to_its_own_forward(no_compile_cache):
    for compiler in ("aot_eager", "inductor"):
        torch._dynamo.reset()

        def compile_(m):
            return torch.compile(m, backend=leancompile.backend(compiler=compiler))

        _check_attribution(*_attribution(compile_, compile_))


def test_install_reports_a_compile_served_from_the_cache(clean_inductor_pass, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = mlp()
    x = torch.randn(4, 16)
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True), \
            leancompile.install() as installed:
        torch.compile(model)(x).sum().backward()
        first = leancompile.last_report()
        assert not first.cached and first.phases == ["forward", "backward"]
        # Recompiled from scratch (a reset also clears Dynamo's compile callbacks): the graphs
        # and our pass uuid are the same, so Inductor serves them from its caches.
        torch._dynamo.reset()
        torch.compile(model)(x).sum().backward()
        hit = leancompile.last_report()
        assert hit is not first and hit.cached and not hit.graphs
        assert "served from Inductor's compile cache" in str(hit)
        assert installed.reports == [first, hit]


def test_uninstall_refuses_to_drop_a_pass_installed_on_top(clean_inductor_pass):
    inductor_config.post_grad_custom_pre_pass = None
    installed = leancompile.install()
    later = CountingPass()
    inductor_config.post_grad_custom_pre_pass = later
    with pytest.raises(RuntimeError, match="installed after leancompile.install"):
        installed.uninstall()
    assert inductor_config.post_grad_custom_pre_pass is later


def test_install_bad_options():
    with pytest.raises(TypeError, match="takes no compiler option"):
        leancompile.install(compiler="aot_eager")
    with pytest.raises(TypeError, match="unknown leancompile option"):
        leancompile.install(dissable=("canonicalize",))


def test_uuid_covers_options_and_previous_pass():
    base = LeanGraphPass(CompileOptions()).uuid()
    assert isinstance(base, str) and base == LeanGraphPass(CompileOptions()).uuid()
    assert LeanGraphPass(CompileOptions(disable=("canonicalize",))).uuid() != base
    assert LeanGraphPass(CompileOptions(compiler="aot_eager")).uuid() != base
    chained = LeanGraphPass(CompileOptions(), previous=CountingPass("a")).uuid()
    assert chained not in (None, base)
    assert LeanGraphPass(CompileOptions(), previous=CountingPass("b")).uuid() != chained
    # A previous pass without a uuid makes the chain uncacheable, as Inductor would treat it.
    assert LeanGraphPass(CompileOptions(), previous=CountingPass(None)).uuid() is None
    assert LeanGraphPass(CompileOptions(), previous=lambda graph: None).uuid() is None


def _uuid_worker(rank, world_size, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        uuid = LeanGraphPass(CompileOptions()).uuid()
        gathered = [None] * world_size
        dist.all_gather_object(gathered, uuid)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(gathered))
    finally:
        dist.destroy_process_group()


def test_uuid_differs_across_ranks(tmp_path):
    world_size = 2
    spawn(_uuid_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path)),
          nprocs=world_size, join=True)
    seen = [(tmp_path / f"rank{r}.txt").read_text().split("\n") for r in range(world_size)]
    assert seen[0] == seen[1]  # every rank saw the same list
    assert len(set(seen[0])) == world_size  # and the two uuids differ
