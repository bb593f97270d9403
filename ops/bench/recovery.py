"""Recovery with and without the local checkpoint tier: steps lost and seconds back to training.

One config (a GPT of `--d-model` x `--layers`), one set of failure steps drawn at random (`--seed`),
three arms, each a fresh run dir trained to `--steps` with a SIGKILL after each failure step and
the same command started again at once:
* `disk`: checkpoints to a run dir on local disk every `--persistent-every` steps only;
* `s3`: the same with the run dir on S3 (moto's server on loopback, ops/s3/local_server.py, started
  here in its own process; logs in a local folder);
* `s3+local`: the `s3` arm plus `[checkpoint.local]` every `--local-every` steps in `--local-dir`
  (default /dev/shm when there is one: the RAM tier).
Per failure: the steps lost (the last step the killed process logged minus the step the next one
resumed from, both from its `start` event) and the seconds from the restart (process launch) to
training again (its `start` event, written just before the first resumed step; metrics.jsonl
cannot say, a later resume from the same step cuts it back), with `restore_s` (finding, verifying
and loading the checkpoint) of the `start` event. The time to redo the lost steps is steps lost x
the step time. Per arm also the mean blocking seconds of a save in each tier (`checkpoint` and
`local_checkpoint` events; saves are synchronous here, so that is the whole save) and the
checkpoint's size: the inputs of ops/bench/goodput_model.py.

    python ops/bench/recovery.py --failures 3 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.toml"
S3_SERVER = ROOT / "ops" / "s3" / "local_server.py"
BUCKET = "harness-bench"
# moto accepts any credentials; these keep the children off the instance-metadata probe and real keys
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true"}


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start_s3() -> tuple[subprocess.Popen, str]:
    """ops/s3/local_server.py on a free loopback port, in its own process; (process, endpoint) once
    the bucket exists."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(S3_SERVER), "--port", str(port), "--bucket", BUCKET],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()  # printed once the bucket exists
    if not line.startswith("S3 server on"):
        proc.kill()
        raise SystemExit(f"the local S3 server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{port}"


def launch(run_dir: str, log_dir: Path, args: argparse.Namespace, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "harness.cli", "--log-level", "warning", "train", str(CONFIG),
           "--run-dir", run_dir, "--set", f"log_dir='{log_dir}'", "--set", f"train.steps={args.steps}",
           "--set", "train.eval_every=0",
           "--set", f"checkpoint.every_steps={args.persistent_every}", "--set", "checkpoint.async_save=false",
           "--set", f"model.args.d_model={args.d_model}", "--set", f"model.args.n_layer={args.layers}",
           "--set", "model.args.n_head=8", "--set", "data.batch_size=2", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **S3_ENV})


def logged_step(log_dir: Path) -> int:
    return max((r["step"] for r in records(log_dir / "metrics.jsonl") if "loss" in r), default=0)


def arm(run_dir: str, log_dir: Path, failures: list[int], args: argparse.Namespace, extra: list[str]) -> dict:
    """Train with a SIGKILL after each step of `failures` and a restart at once: one record per
    restart (`restarts`), the median step time and the mean blocking seconds of a save per tier."""
    launches = []
    proc = launch(run_dir, log_dir, args, extra)
    for step in failures:
        while logged_step(log_dir) < step:
            if proc.poll() is not None:
                raise SystemExit(f"exited {proc.returncode} before step {step}:\n{proc.stderr.read()[-2000:]}")
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        launches.append(time.time())
        proc = launch(run_dir, log_dir, args, extra)
    if proc.wait(1800) != 0:
        raise SystemExit(f"the last process exited {proc.returncode}:\n{proc.stderr.read()[-2000:]}")
    events = records(log_dir / "events.jsonl")
    starts = [e for e in events if e["event"] == "start"][1:]
    restarts = []
    for launched, start in zip(launches, starts, strict=False):
        resumed = start["resumed_from"] or 0
        restarts.append({"resumed_from": resumed, "tier": start.get("resumed_tier"), "restore_s": start["restore_s"],
                         "lost": (start["previous_reached"] or resumed) - resumed,
                         "to_ready_s": start["time"] - launched})
    steps = {r["step"]: r["time"] for r in records(log_dir / "metrics.jsonl") if "loss" in r}
    saves = {kind: [e["blocking_s"] for e in events if e["event"] == kind]
             for kind in ("checkpoint", "local_checkpoint")}
    nbytes = [e["bytes"] for e in events if e["event"] == "local_checkpoint"]
    return {"restarts": restarts, "step_s": statistics.median(steps[s] - steps[s - 1] for s in steps if s - 1 in steps),
            "save_s": {kind: statistics.mean(v) for kind, v in saves.items() if v}, "bytes": max(nbytes, default=None)}


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
    server, endpoint = start_s3()
    try:
        with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=args.local_dir) as local:
            on_s3 = ["--set", f"checkpoint.storage_options.endpoint_url='{endpoint}'"]
            tier = ["--set", f"checkpoint.local.dir='{local}'",
                    "--set", f"checkpoint.local.every_steps={args.local_every}"]
            arms = (("disk", str(Path(tmp) / "disk"), []),
                    ("s3", f"s3://{BUCKET}/s3", on_s3),
                    ("s3+local", f"s3://{BUCKET}/s3-local", [*on_s3, *tier]))
            for name, run_dir, extra in arms:
                out = arm(run_dir, Path(tmp) / f"{name}-logs", failures, args, extra)
                rows = out["restarts"]
                for r in rows:
                    print(f"  {name:<9} resumed from {r['resumed_from']} ({r['tier']}): {r['lost']} steps lost, "
                          f"{r['to_ready_s']:.2f} s to training again (restore {r['restore_s']:.3f} s)")
                lost, step_s = statistics.mean(r["lost"] for r in rows), out["step_s"]
                saves = ", ".join(f"{kind} save {s:.3f} s" for kind, s in out["save_s"].items())
                size = f", checkpoint {out['bytes'] / 2**20:.1f} MiB" if out["bytes"] else ""
                redo = lost * step_s
                print(f"{name:<9} mean: {lost:.1f} steps lost (x {step_s:.3f} s a step = {redo:.1f} s to redo), "
                      f"{statistics.mean(r['to_ready_s'] for r in rows):.2f} s restart -> training again, "
                      f"restore {statistics.mean(r['restore_s'] for r in rows):.3f} s; {saves}{size}")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
