"""Importing leancompile changes no torch config and no environment variable."""

import subprocess
import sys
import textwrap


def test_import_changes_no_config_or_env():
    script = textwrap.dedent("""
        import os, pickle, torch
        import torch._inductor.config, torch._dynamo.config, torch._functorch.config
        def snapshot():
            return (dict(os.environ),
                    {k: repr(v) for k, v in torch._inductor.config.get_config_copy().items()},
                    {k: repr(v) for k, v in torch._dynamo.config.get_config_copy().items()},
                    {k: repr(v) for k, v in torch._functorch.config.get_config_copy().items()})
        before = snapshot()
        import leancompile, leancompile.passes, leancompile.runtime, leancompile.grpo
        import leancompile.integrations, leancompile.cli
        after = snapshot()
        for name, b, a in zip(("environ", "inductor", "dynamo", "functorch"), before, after):
            changed = sorted(k for k in set(b) | set(a) if b.get(k) != a.get(k))
            assert not changed, (name, changed)
        print("unchanged")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "unchanged"
