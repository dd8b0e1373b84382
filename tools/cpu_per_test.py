"""Where the test suite's CPU goes, per test: a pytest plugin, and its summary.

Each test's CPU is summed over the pytest process's whole tree at the test's start and end: its
own, its children's (waited ones through ``cutime``), its fork server's (``tests/ranks.py``) and
so every rank's. With ``tools/gxx/g++`` as ``CXX``, every g++ run Inductor starts is logged with
its CPU and the test whose process tree started it.

    rm -rf /tmp/leancompile-cpu
    PYTHONPATH=tools CXX=$PWD/tools/gxx/g++ make test \\
        PYTEST_ARGS="-n 2 --dist loadfile -p cpu_per_test"
    python tools/cpu_per_test.py            # per file and the slowest tests, CPU seconds

``LEANCOMPILE_CPU_LOG`` names the folder (default ``/tmp/leancompile-cpu``). Linux only (reads
``/proc``)."""

from __future__ import annotations

import collections
import json
import os
import sys
import time

OUT = os.environ.get("LEANCOMPILE_CPU_LOG", "/tmp/leancompile-cpu")
_TICK = os.sysconf("SC_CLK_TCK")
_started: dict[str, tuple[float, float]] = {}


def _tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and every live process under it (reaped ones are in their
    parent's ``cutime``/``cstime``)."""
    children, cpu = collections.defaultdict(list), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        pid = int(entry)
        children[int(fields[1])].append(pid)
        cpu[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0)
        stack.extend(children[pid])
    return total / _TICK


_counting = [True]


def pytest_configure(config):
    # pytest-xdist's controller reports its workers' tests too: count them where they run
    controller = bool(getattr(config.option, "numprocesses", None)) and \
        not hasattr(config, "workerinput")
    _counting[0] = not controller


def pytest_runtest_logstart(nodeid, location):
    if not _counting[0]:
        return
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"current.{os.getpid()}"), "w") as f:
        f.write(nodeid)  # read by tools/gxx/g++
    _started[nodeid] = (time.time(), _tree_cpu(os.getpid()))


def pytest_runtest_logfinish(nodeid, location):
    if nodeid not in _started:
        return
    t0, cpu0 = _started.pop(nodeid)
    record = {"test": nodeid, "wall": time.time() - t0, "cpu": _tree_cpu(os.getpid()) - cpu0}
    with open(os.path.join(OUT, f"tests.{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def summary(out: str = OUT, top: int = 15) -> None:
    tests = []
    for name in sorted(os.listdir(out)):
        if name.startswith("tests."):
            with open(os.path.join(out, name)) as f:
                tests += [json.loads(line) for line in f]
    gxx, runs = collections.Counter(), collections.Counter()
    if os.path.exists(os.path.join(out, "gxx.log")):
        with open(os.path.join(out, "gxx.log")) as f:
            for line in f:
                user, system, test = (line.rstrip("\n").split(" ", 2) + [""])[:3]
                gxx[test] += float(user) + float(system)
                runs[test] += 1
    per_file = collections.defaultdict(lambda: [0.0, 0.0])
    for t in tests:
        row = per_file[t["test"].split("::")[0]]
        row[0] += t["cpu"]
        row[1] += gxx.get(t["test"], 0.0)
    print(f"{len(tests)} tests, {sum(t['cpu'] for t in tests):.0f} CPU-s; g++ "
          f"{sum(gxx.values()):.0f} CPU-s in {sum(runs.values())} runs")
    print(f"{'CPU s':>7} {'g++ s':>7}  file")
    for name, (cpu, g) in sorted(per_file.items(), key=lambda kv: -kv[1][0]):
        print(f"{cpu:7.0f} {g:7.0f}  {name}")
    print(f"\n{'CPU s':>7} {'wall s':>7} {'g++ s':>7}  slowest tests")
    for t in sorted(tests, key=lambda t: -t["cpu"])[:top]:
        print(f"{t['cpu']:7.0f} {t['wall']:7.0f} {gxx.get(t['test'], 0.0):7.0f}  {t['test']}")


if __name__ == "__main__":
    summary(*sys.argv[1:2])
