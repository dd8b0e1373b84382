import os

import pytest
import torch

# A pass that raises inside the test suite is a bug to see, not a site to skip: the safety net
# of the passes re-raises (spawned workers inherit this; the safety-net tests unset it).
os.environ.setdefault("LEANCOMPILE_ON_ERROR", "raise")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no Dynamo cache entries or recompile counts carried
    over from another test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_compile_cache():
    """Inductor's FX graph cache and AOTAutograd cache off, so the passes really run (a cache
    hit skips every post-grad pass, ours included)."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
