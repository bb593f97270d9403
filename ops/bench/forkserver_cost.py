"""The CPU price of one short `harness` process: forked by a fork server (harness/forkserver)
against a fresh interpreter, as a ratio, measured in the same run.

Contenders, alternating within each round (a shared machine's load moves between minutes), in
the test suite's environment (OMP_NUM_THREADS=1):
* `harness ckpt --help` (imports torch, trains nothing);
* `harness train tests/data/tiny.toml --set train.steps=4` (what the suite's processes do).
A fresh process's CPU time (user + system) comes from `os.wait4`; a forked one's from its
server's counters of reaped children (/proc/PID/stat cutime + cstime, read before and after:
one process at a time). The server's own start (the imports, once) is printed apart.

    python ops/bench/forkserver_cost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.forkserver.client import ForkServer

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TICK = os.sysconf("SC_CLK_TCK")


def reaped_cpu(pid: int) -> float:
    """CPU seconds of the children `pid` has reaped (cutime + cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / TICK


def fresh(args: list[str]) -> float:
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, args
    return usage.ru_utime + usage.ru_stime


def forked(server: ForkServer, args: list[str]) -> float:
    before = reaped_cpu(server.process.pid)
    proc = server.popen([sys.executable, "-m", "harness.cli", *args], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT)
    assert proc.forked and proc.wait() == 0, args
    return reaped_cpu(server.process.pid) - before


def contenders(work: str, r: int) -> dict[str, list[str]]:
    tiny = ["train", str(ROOT / "tests/data/tiny.toml"), "--set", "train.steps=4", "--run-dir"]
    return {"ckpt --help": ["ckpt", "--help"], "train tiny, 4 steps": tiny + [f"{work}/run-{r}-"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory(prefix="harness-fs-") as work:
        server = ForkServer(ENV, ROOT, work)
        try:
            started = time.monotonic()
            assert server.popen([sys.executable, "-m", "harness.cli", "--help"], stdout=subprocess.DEVNULL,
                                env=ENV, cwd=ROOT).wait() == 0
            print(f"server start (its imports) and a first --help: {time.monotonic() - started:.1f} s wall")
            for r in range(rounds):
                for name, args in contenders(work, r).items():
                    # A run dir each: the same path twice would resume a finished run.
                    own = {who: [*args[:-1], args[-1] + who] if name.startswith("train") else args
                           for who in ("fresh", "forked")}
                    runs = [("fresh", lambda own=own: fresh(own["fresh"])),
                            ("forked", lambda own=own: forked(server, own["forked"]))]
                    figures = {who: run() for who, run in (runs if r % 2 == 0 else runs[::-1])}
                    print(f"{name}: round {r + 1}: fresh {figures['fresh']:.2f} CPU-s, forked "
                          f"{figures['forked']:.2f} CPU-s, {figures['fresh'] / figures['forked']:.1f}x")
        finally:
            server.close()


if __name__ == "__main__":
    main()
