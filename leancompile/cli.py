"""Command line: ``leancompile explain FILE.py:NAME``, ``leancompile demo [grpo|loop|race|explain|
overlap]``, ``leancompile bench NAME``, ``leancompile plan``, ``leancompile trace``, ``leancompile
check-inputs``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

__all__ = ["main", "load_target"]


def _load_module(spec: str):
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec)
        if not path.is_file():
            raise SystemExit(f"leancompile: no such file {spec!r}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
        return module
    return importlib.import_module(spec)


def load_target(target: str, args_name: str = "example_args"):
    """``FILE.py:NAME`` or ``package.module:NAME`` -> (the callable, its example arguments).

    The arguments come from ``args_name`` in the same file: a tuple, or a function returning
    one."""
    if ":" not in target:
        raise SystemExit(f"leancompile: expected FILE.py:NAME or module:NAME, got {target!r}")
    where, name = target.rsplit(":", 1)
    module = _load_module(where)
    if not hasattr(module, name):
        raise SystemExit(f"leancompile: {where} has no {name!r}")
    if not hasattr(module, args_name):
        raise SystemExit(
            f"leancompile: {where} defines no {args_name!r}; add `def {args_name}(): return "
            f"(tensor, ...)` with example arguments for {name}, or name another with --args")
    args = getattr(module, args_name)
    args = args() if callable(args) else args
    if not isinstance(args, tuple):
        args = (args,)
    return getattr(module, name), args


def _cmd_explain(ns) -> int:
    from .explain import explain

    options = {"compiler": ns.compiler}
    if ns.disable:
        options["disable"] = tuple(ns.disable)
    if ns.overlap:
        options["overlap"] = ns.overlap
    if ns.variant:
        options["variant"] = ns.variant
    if ns.bucket_cap_mb:
        options["bucket_cap_mb"] = ns.bucket_cap_mb
    if ns.fake_world:
        from .sim.fullscale import fake_group

        with fake_group(ns.fake_world):  # the target's collectives trace, nothing moves
            fn, args = load_target(ns.target, ns.args)
            report = explain(fn, *args, **options)
    else:
        fn, args = load_target(ns.target, ns.args)
        report = explain(fn, *args, **options)
    rows = None
    if ns.device:
        from .sim import exposure

        rows = exposure(report, ns.device, world_size=ns.fake_world)
    if ns.json:
        data = report.to_dict()
        if rows is not None:
            data["predicted_exposure"] = {"device": ns.device, "rows": rows}
        print(json.dumps(data, indent=2, default=str))
    else:
        print(report)
        if rows is not None:
            print(f"\npredicted exposed communication on {ns.device} (leancompile/sim), "
                  "before -> after the passes:")
            for row in rows:
                print(f"  {row['graph']:22s} {row['site']:32s} {row['before_s'] * 1e3:9.3f} ms "
                      f"-> {row['after_s'] * 1e3:9.3f} ms")
    if ns.out:
        page = report.save(ns.out)
        print(f"wrote graph code and {page}", file=sys.stderr if ns.json else sys.stdout)
    return 0


def _cmd_demo(ns) -> int:
    from .demos import run_demo

    sp = ns.sp_size if ns.sp_size is not None else 2 if ns.sp else None
    if sp is not None and ns.name not in ("overlap", "grpo"):
        raise SystemExit("--sp goes with `leancompile demo overlap` (the sequence-parallel DiT) "
                         "or `demo grpo` (under torchrun: sequence-parallel groups of ranks)")
    if ns.name == "overlap" and sp not in (None, 2):
        raise SystemExit(f"--sp-size {sp}: the overlap demo's sequence-parallel FLUX runs on 2 "
                         "ranks")
    return run_demo(ns.name, out=ns.out, sp=sp)


def _cmd_check_inputs(ns) -> int:
    from .check_inputs import main as check_main

    return check_main(ns.rest)


def _cmd_bench(ns) -> int:
    if ns.name == "grpo":
        from .benchmarks.grpo import main as bench_main
    elif ns.name == "loop":
        from .benchmarks.loop import main as bench_main
    elif ns.name == "compile":
        from .benchmarks.compile_overhead import main as bench_main
    elif ns.name == "buckets":
        from .benchmarks.buckets import main as bench_main
    elif ns.name == "soak":
        from .benchmarks.soak import main as bench_main
    elif ns.name == "overhead":
        from .benchmarks.overhead import main as bench_main
    elif ns.name == "realloop":
        from .benchmarks.realloop import main as bench_main
    else:
        from .benchmarks.overlap import main as bench_main
    return bench_main(ns.rest)


def _cmd_plan(ns) -> int:
    from .sim.plan import main as plan_main

    return plan_main(ns.rest)


def _cmd_trace(ns) -> int:
    from .benchmarks.trace import main as trace_main

    return trace_main([ns.what] + ns.rest)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="leancompile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("explain", help="show what leancompile's passes do to a function's graphs")
    p.add_argument("target", help="FILE.py:NAME or package.module:NAME")
    p.add_argument("--args", default="example_args",
                   help="name in the same file of the example arguments (a tuple or a function "
                        "returning one); default: example_args")
    p.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager"))
    p.add_argument("--disable", action="append", default=[], help="pass name to skip")
    p.add_argument("--out", help="folder for the before/after code and report.html")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--overlap", choices=("flash", "slice"), help="turn on an overlap pass")
    p.add_argument("--variant", choices=("ring", "direct"))
    p.add_argument("--bucket-cap-mb", type=float, metavar="MIB",
                   help="turn on the bucketing pass: consecutive all-gathers / reduce-scatters "
                        "merged into buckets of at most MIB")
    p.add_argument("--fake-world", type=int, metavar="N",
                   help="trace under a fake process group of N ranks (collectives without "
                        "a real job)")
    p.add_argument("--device", help="also predict each collective's exposed time before and "
                   "after the passes on this device profile (leancompile/sim)")
    p.set_defaults(func=_cmd_explain)

    d = sub.add_parser("demo", help="run a demo")
    d.add_argument("name", nargs="?", default="grpo",
                   choices=("grpo", "loop", "race", "explain", "overlap"))
    d.add_argument("--out", default="leancompile-out", help="output folder")
    d.add_argument("--sp", action="store_true",
                   help="overlap demo: a Ulysses sequence-parallel FLUX instead of the TP+SP "
                        "block; grpo demo under torchrun: the transformer sequence parallel "
                        "over groups of 2 ranks (--sp-size), data parallel over the groups")
    d.add_argument("--sp-size", type=int, default=None, metavar="N",
                   help="grpo demo: ranks per sequence-parallel group (implies --sp)")
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser("bench", help="run a benchmark (leancompile bench grpo --help)",
                       add_help=False)
    b.add_argument("name", choices=("grpo", "loop", "overlap", "compile", "soak", "buckets",
                                       "overhead", "realloop"))
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_cmd_bench)

    c = sub.add_parser("check-inputs", help="the bad-input matrix: invalid arguments of every "
                       "public entry point and the errors they raise", add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    c.set_defaults(func=_cmd_check_inputs)

    pl = sub.add_parser("plan", help="predict step time and memory of the LeanGRPO schedules "
                        "for a real model on a device profile (leancompile plan grpo --help)",
                        add_help=False)
    pl.add_argument("name", choices=("grpo",))
    pl.add_argument("rest", nargs=argparse.REMAINDER)
    pl.set_defaults(func=_cmd_plan)

    tr = sub.add_parser("trace", help="one step as Chrome-trace JSON and a PNG timeline, "
                        "measured and simulated (leancompile trace overlap|grpo --help)",
                        add_help=False)
    tr.add_argument("what", choices=("overlap", "grpo"))
    tr.add_argument("rest", nargs=argparse.REMAINDER)
    tr.set_defaults(func=_cmd_trace)

    ns = parser.parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
