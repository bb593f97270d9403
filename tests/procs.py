"""Real `harness` processes for tests: start, wait for a step, kill, compare finished runs.

They start through the session's fork server (`SERVERS`, set by tests/conftest.py: torch is
imported once per server, not once per process; harness/forkserver), which starts a fresh
interpreter for an environment it cannot honour; with HARNESS_TESTS_FRESH=1 every one is fresh.
Commands that start `harness` processes themselves (torchrun, a supervisor, launcher scripts)
start with `spawn`: their `harness` processes relay to the same server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from harness.checkpoint import CheckpointStore
from harness.checkpoint.diff import diff_checkpoints
from harness.forkserver.pool import ForkServers
from harness.forkserver.relay import SERVER_ENV
from harness.repro import numerics

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny.toml"

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# As users run `harness train`: torch's default thread count and no reproducibility settings from
# outside (the harness sets its own, harness/repro/numerics.py).
DEFAULT_THREADS_ENV = {k: v for k, v in ENV.items()
                       if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "MKL_DYNAMIC", "OMP_DYNAMIC")}

# Bitwise comparisons of oneMKL products computed by different call sequences were written on
# Intel CPUs and hold there. On an AMD EPYC (AVX2) machine on 2026-12-01 two did not: MKL gave
# one result on 1 and 2 threads even without strict mode, and the batched Newton-Schulz (a tall
# matrix iterates in a contiguous slot of the stack) differed in the last bits from the
# reference (which iterates on the tall matrix's transposed view): MKL there sums a product in
# another order for another operand layout. The per-matrix path keeps the reference's layout.
INTEL_CPU = numerics.cpu().vendor == "GenuineIntel"
MKL_BITWISE_ON_INTEL = dict(condition=not INTEL_CPU, strict=False,
                            reason="bitwise oneMKL comparisons hold on Intel CPUs; on this one they did not "
                                   "(tests/procs.py)")


# The test session's fork servers (tests/conftest.py), or None: every process a fresh interpreter.
SERVERS: ForkServers | None = None


def harness(*args: str, timeout: float = 300, check: bool = False,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `harness ARGS` to completion; returns the completed process (text output). Past
    `timeout` seconds it is killed and TimeoutExpired raised, as subprocess.run does."""
    proc = finished(start(*args, env=env), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"harness {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def finished(running: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    """`running` (started with its output piped) waited for as subprocess.run waits: the completed
    process; past `timeout` seconds it is killed and TimeoutExpired raised."""
    with running:
        try:
            out, err = running.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            running.kill()
            running.wait()
            raise
    return subprocess.CompletedProcess(running.args, running.returncode, out, err)


def assert_one_line_error(proc, needle: str) -> None:
    """Exit 2, no traceback, and an `error: ` line naming the problem (details may follow it)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    _, sep, message = proc.stderr.partition("\nerror: ")
    message = message or proc.stderr.removeprefix("error: ")
    assert (sep or proc.stderr.startswith("error: ")) and needle in message, proc.stderr


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`harness ARGS` started with stdout and stderr piped (text), in ROOT."""
    return popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV)


def popen(args: list[str], **kwargs) -> subprocess.Popen:
    """`harness ARGS` started in ROOT with Popen's `kwargs`, forked by the session's server if
    there is one."""
    return spawn([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, **kwargs)


def spawn(args: list[str], **kwargs) -> subprocess.Popen:
    """Popen of a command line (`harness` ones forked by the session's server, if there is one),
    with that server named in its environment: the `harness` processes it starts as fresh
    interpreters (torchrun's workers, a supervisor's children) have it fork them
    (harness/forkserver/relay.py)."""
    start_process = SERVERS.popen if SERVERS is not None else subprocess.Popen
    return start_process(args, **kwargs)


def relayed(process: psutil.Process) -> psutil.Process:
    """The process that does `process`'s work: where `process` is a relay (its environment names a
    fork server: harness/forkserver/relay.py), the server's child it stands for, found as the
    process that holds the other end of the relay's lifeline (its one pipe past stdio; the
    child's own forked workers hold it too); else `process` itself. Call it once the work began."""
    if SERVER_ENV not in process.environ():
        return process
    lifeline = set(_pipes(process.pid, above=2))
    holders = {p.pid: p for p in psutil.process_iter() if p.pid != process.pid and lifeline & set(_pipes(p.pid))}
    children = [p for p in holders.values() if p.ppid() not in holders]
    assert len(children) == 1, f"pid {process.pid}: relaying to {children}?"
    return children[0]


def _pipes(pid: int, above: int = -1) -> list[str]:
    """The pipes ("pipe:[inode]") open in process `pid` at fds above `above` (none if it is gone)."""
    found = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if int(fd) > above and target.startswith("pipe:"):
                    found.append(target)
    return found


def last_step(log_dir: Path) -> int:
    path = Path(log_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def wait_for_step(proc: subprocess.Popen, log_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while last_step(log_dir) < step:
        if proc.poll() is not None:
            raise AssertionError(f"process exited {proc.returncode} before step {step}:\n{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no step {step} within {timeout}s")
        time.sleep(0.02)


def kill_at_step(args: list[str], log_dir: Path, step: int, sig: int = signal.SIGKILL,
                 env: dict | None = None, timeout: float = 120) -> int:
    """Start `harness ARGS`, send `sig` once step `step` is logged (a process that has not logged
    it within `timeout` seconds is taken for hung), return the exit code."""
    proc = start(*args, env=env)
    wait_for_step(proc, log_dir, step, timeout)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    return proc.returncode


def losses(log_dir: Path) -> dict[int, float]:
    """step -> training loss from metrics.jsonl (asserts each step appears once)."""
    out: dict[int, float] = {}
    for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            assert rec["step"] not in out, f"step {rec['step']} logged twice"
            out[rec["step"]] = rec["loss"]
    return out


def events(log_dir: Path, kind: str | None = None, *, missing_ok: bool = False) -> list[dict]:
    """The records of the run's events.jsonl, in order (every line must be one: the harness writes no
    other); with `kind`, those whose "event" is `kind`. No file is an error, or with `missing_ok`
    no events (a run still starting)."""
    path = Path(log_dir) / "events.jsonl"
    if missing_ok and not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return records if kind is None else [e for e in records if e["event"] == kind]


def final_checkpoint(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def assert_same_run(a: Path, b: Path, steps: int) -> None:
    """Final checkpoints bitwise equal and per-step losses identical. The checkpoints are compared
    by what `harness ckpt diff` runs (tests/checkpoint/test_cli.py tests the command), here in
    this process: a `harness` process more per comparison costs three CPU-seconds of imports."""
    stores = CheckpointStore(str(a)), CheckpointStore(str(b))
    lines, equal = diff_checkpoints(*((store, store.ref(steps)) for store in stores))
    assert equal, "final checkpoints differ:\n" + "\n".join(lines)
    la, lb = losses(a), losses(b)
    assert sorted(la) == list(range(1, steps + 1)), f"steps logged: {sorted(la)}"
    assert la == lb
