"""Recovery with and without the local checkpoint tier: steps lost and seconds back to training.

One config (a GPT of `--d-model` x `--layers`), one set of failure steps drawn at random (`--seed`),
two arms, each a fresh run dir trained to `--steps` with a SIGKILL after each failure step and the
same command started again at once:
* `persistent`: checkpoints to the run dir every `--persistent-every` steps only;
* `local`: the same, plus `[checkpoint.local]` every `--local-every` steps in `--local-dir`
  (default /dev/shm when there is one: the RAM tier).
Per failure: the steps lost (the last step the killed process logged minus the step the next one
resumed from, both from its `start` event) and the seconds from the restart (process launch) to
training again (its `start` event, written just before the first resumed step; metrics.jsonl
cannot say, a later resume from the same step cuts it back), with `restore_s` (finding, verifying
and loading the checkpoint) of the `start` event. The time to redo the lost steps is steps lost x
the step time. The run dir is on local disk here, so the
persistent tier's read is fast too: the gap is mostly the steps lost.

    python ops/bench/recovery.py --failures 3 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.toml"


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(run_dir: Path, args: argparse.Namespace, local: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "harness.cli", "--log-level", "warning", "train", str(CONFIG),
           "--run-dir", str(run_dir), "--set", f"train.steps={args.steps}", "--set", "train.eval_every=0",
           "--set", f"checkpoint.every_steps={args.persistent_every}", "--set", "checkpoint.async_save=false",
           "--set", f"model.args.d_model={args.d_model}", "--set", f"model.args.n_layer={args.layers}",
           "--set", "model.args.n_head=8", "--set", "data.batch_size=2"]
    if local is not None:
        cmd += ["--set", f"checkpoint.local.dir='{local}'", "--set", f"checkpoint.local.every_steps={args.local_every}"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def logged_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir / "metrics.jsonl") if "loss" in r), default=0)


def arm(run_dir: Path, failures: list[int], args: argparse.Namespace, local: str | None) -> list[dict]:
    """Train with a SIGKILL after each step of `failures` and a restart at once; one record per restart."""
    launches = []
    proc = launch(run_dir, args, local)
    for step in failures:
        while logged_step(run_dir) < step:
            if proc.poll() is not None:
                raise SystemExit(f"exited {proc.returncode} before step {step}:\n{proc.stderr.read()[-2000:]}")
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        launches.append(time.time())
        proc = launch(run_dir, args, local)
    if proc.wait(1800) != 0:
        raise SystemExit(f"the last process exited {proc.returncode}:\n{proc.stderr.read()[-2000:]}")
    starts = [e for e in records(run_dir / "events.jsonl") if e["event"] == "start"][1:]
    out = []
    for launched, start in zip(launches, starts):
        resumed = start["resumed_from"] or 0
        out.append({"resumed_from": resumed, "tier": start.get("resumed_tier"), "restore_s": start["restore_s"],
                    "lost": (start["previous_reached"] or resumed) - resumed, "to_ready_s": start["time"] - launched})
    steps = {r["step"]: r["time"] for r in records(run_dir / "metrics.jsonl") if "loss" in r}
    step_s = statistics.median(steps[s] - steps[s - 1] for s in steps if s - 1 in steps)
    return [{**r, "step_s": step_s} for r in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--failures", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--persistent-every", type=int, default=20)
    p.add_argument("--local-every", type=int, default=2)
    p.add_argument("--local-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    failures = sorted(random.Random(args.seed).sample(range(3, args.steps - 2), args.failures))
    print(f"failures after steps {failures}; {args.steps} steps; persistent every {args.persistent_every}, "
          f"local every {args.local_every} in {args.local_dir or 'a temporary folder'}")
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=args.local_dir) as local:
        for name, tier in (("persistent", None), ("local", local)):
            rows = arm(Path(tmp) / name, failures, args, tier)
            for r in rows:
                print(f"  {name:<11} resumed from {r['resumed_from']} ({r['tier']}): {r['lost']} steps lost, "
                      f"{r['to_ready_s']:.2f} s to training again (restore {r['restore_s']:.3f} s)")
            lost, step_s = statistics.mean(r["lost"] for r in rows), rows[0]["step_s"]
            print(f"{name:<11} mean: {lost:.1f} steps lost (x {step_s:.2f} s a step = {lost * step_s:.1f} s to redo), "
                  f"{statistics.mean(r['to_ready_s'] for r in rows):.2f} s restart -> training again, "
                  f"restore {statistics.mean(r['restore_s'] for r in rows):.3f} s")


if __name__ == "__main__":
    main()
