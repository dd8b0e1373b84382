import os

import pytest
import torch

from collector import freeze, tune

tune()

# A pass that raises inside the test suite is a bug to see, not a site to skip: the safety net
# of the passes re-raises (spawned workers inherit this; the safety-net tests unset it).
os.environ.setdefault("LEANCOMPILE_ON_ERROR", "raise")


# The longest files (seconds of test time in a two-worker fresh-clone run on the 2-core CI
# machine kind, 2026-12-06 at 96ae678: 409, 384, 361, 222, 178, 161, 157, 140, 128, 109, 103),
# most of them starting 2 to 4 ranks.
# pytest-xdist's --dist loadfile hands files out in collection order; alphabetically,
# test_ulysses.py came last, and one worker ran it alone for minutes while the other had
# nothing left (a rank computing a one-process reference leaves a core idle). Longest first.
LONGEST_FIRST = ("test_real_loops.py", "test_ulysses.py", "test_flash_overlap_safety.py",
                 "test_grpo_fsdp.py", "test_flash_overlap.py", "test_grpo_bench_explain.py",
                 "test_bf16.py", "test_grpo_trainer.py", "test_torchtitan.py",
                 "test_grpo_distributed.py", "test_lean_step.py")


def pytest_collection_finish(session):
    """The test modules are imported: their objects (and torch's) out of the collector's way."""
    freeze()


def pytest_collection_modifyitems(config, items):
    """The files of ``LONGEST_FIRST`` first, in that order (each file's own order kept)."""
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo_per_module():
    """Each test module starts and ends with Dynamo reset."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """Each test compiles from scratch: no Dynamo cache entries or recompile counts carried
    over from another test. A module that sets ``DYNAMO_RESET = "module"`` is reset once
    (above): its tests call again what its module fixtures compiled, where a reset would make
    them capture the same graphs again (its compiles must not share a code object: each
    ``lean_compile`` step has its own)."""
    per_test = getattr(request.module, "DYNAMO_RESET", "test") == "test"
    if per_test:
        torch._dynamo.reset()
    yield
    if per_test:
        torch._dynamo.reset()


@pytest.fixture
def no_compile_cache():
    """Inductor's FX graph cache and AOTAutograd cache off, so the passes really run (a cache
    hit skips every post-grad pass, ours included)."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
