"""The CPU price of `harness verify-resume`: its whole process tree against one plain
`harness train` of the same steps, as a ratio, measured in the same run.

Both contenders run the same config with the same `--set` items (default: the quickstart, 16
steps, a checkpoint every 4, no evaluation), each a fresh process of this checkout:
* train: `harness train CONFIG` in a new run dir;
* verify-resume: `harness verify-resume CONFIG --interrupt-at 6,11` (A continuously, B killed
  with SIGKILL at each point and resumed, then the comparison).
A contender's figure is the CPU time (user + system) of its process and every process under it,
from `os.wait4` (a child's usage includes the children it waited for, the SIGKILLed ones among
them); wall time is printed beside it. The steps of work verify-resume does are counted from B's
`start` events (A's steps, plus each of B's processes from the step it resumed from to the step
it had logged when it was killed or finished), so the ratio can be read against the work ratio:
CPU above it is overhead (process starts, the comparison, contention). The contenders alternate,
the first place swapping each round; the ratio is taken within each round (a shared machine's
load moves between minutes). A verdict other than `identical` stops the benchmark.

    python ops/bench/verify_resume_cost.py [--rounds 3] [--interrupt-at 6,11] [--set train.steps=16 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.toml"
SETS = ["train.steps=16", "checkpoint.every_steps=4", "train.eval_every=0"]


def measured(cmd: list[str], log: Path) -> tuple[float, float, int]:
    """(CPU seconds of the process tree, wall seconds, exit code) of `cmd` run from this checkout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the children import this checkout's harness
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime, time.perf_counter() - t0, proc.returncode


def steps_of_work(work: Path, steps: int) -> int:
    """A's steps plus the steps each of B's processes trained (from its resume point to the step
    it had logged when it ended)."""
    lines = (work / "interrupted" / "events.jsonl").read_text().splitlines()
    starts = [e for e in map(json.loads, lines) if e.get("event") == "start"]
    ends = [e["previous_reached"] for e in starts[1:]] + [steps]
    return steps + sum(end - (e["resumed_from"] or 0) for e, end in zip(starts, ends, strict=False))


def train(args: argparse.Namespace, work: Path) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "harness.cli", "--log-level", "warning", "train", str(args.config),
           "--run-dir", str(work / "run"), "--set", f'log_dir="{work / "run"}"',
           *[x for s in args.sets for x in ("--set", s)]]
    cpu, wall, code = measured(cmd, work / "train.log")
    if code != 0:
        raise SystemExit(f"harness train failed (exit {code}):\n{(work / 'train.log').read_text()[-2000:]}")
    return cpu, wall


def verify_resume(args: argparse.Namespace, work: Path) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "harness.cli", "verify-resume", str(args.config), "--interrupt-at", args.interrupt_at,
           "--work-dir", str(work / "verify"), *[x for s in args.sets for x in ("--set", s)]]
    cpu, wall, code = measured(cmd, work / "verify.log")
    out = (work / "verify.log").read_text()
    if code != 0 or "\nidentical: " not in out:
        raise SystemExit(f"verify-resume did not say identical (exit {code}):\n{out[-2000:]}")
    return cpu, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--interrupt-at", default="6,11", metavar="S1,S2")
    p.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE",
                   help=f"overrides for both contenders (default: {' '.join(SETS)})")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.sets = args.sets or SETS
    steps = next((int(s.split("=", 1)[1]) for s in reversed(args.sets) if s.startswith("train.steps=")), None)
    print(f"{Path(args.config).name} {' '.join(args.sets)}, verify-resume --interrupt-at {args.interrupt_at}, "
          f"{args.rounds} rounds ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start)")
    rows = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="verify-resume-cost-") as tmp:
            work = Path(tmp)
            order = [train, verify_resume] if r % 2 == 0 else [verify_resume, train]
            t = {f.__name__: f(args, work) for f in order}
            work_steps = steps_of_work(work / "verify", steps) if steps else None
        ratio = t["verify_resume"][0] / t["train"][0]
        rows.append(t)
        done = f"; steps of work {work_steps} = {work_steps / steps:.2f}x" if work_steps else ""
        print(f"round {r + 1}: CPU s train {t['train'][0]:.1f}, verify-resume {t['verify_resume'][0]:.1f}, "
              f"ratio {ratio:.2f}{done}; wall s train {t['train'][1]:.1f}, verify-resume {t['verify_resume'][1]:.1f} "
              f"(load average {os.getloadavg()[0]:.2f})", flush=True)
    ratios = [t["verify_resume"][0] / t["train"][0] for t in rows]
    total = sum(t["verify_resume"][0] for t in rows) / sum(t["train"][0] for t in rows)
    print(f"verify-resume / train, CPU: median {statistics.median(ratios):.2f} "
          f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}; all rounds together {total:.2f}; target <= 3.5)")


if __name__ == "__main__":
    main()
