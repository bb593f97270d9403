"""The multi-rank arm of ops/bench/recovery.py: nodes lost with their disks, at world size 2.

Two "nodes" on this machine, each a torchrun agent of one rank (a static rendezvous on
loopback) with its own local-tier folder in `--local-dir` (default /dev/shm, the RAM tier); the
run dir (the persistent tier) on local disk. The run is a GPT of `--d-model` x `--layers` trained
in exact elastic mode (global batch 8 in micro-batches of 2, one CPU thread per rank: "auto"
turns it on at world sizes 1 and 2), persistent saves every `--persistent-every` steps, local
ones every `--local-every` with peer copies. At each failure step (drawn at random, `--seed`)
every process of the run is SIGKILLed at once, then, per arm:
* `replace`: node 1's folder is deleted (its disk is gone) and both nodes start again (a
  replacement node with an empty disk): world 2 -> 2;
* `shrink`: the failures alternate: a lost node (node 1's folder deleted, node 0 goes on alone as
  one process: 2 -> 1), then a node that joins (the survivor's process is stopped, as torchrun's
  elastic agent stops its workers when a node joins, and both nodes start: 1 -> 2, node 1's
  folder empty);
* `persistent`: no local tier; both nodes start again after each loss (2 -> 2).
Per failure: the tier resumed from and the steps lost (the last step the killed run logged minus
the step resumed from, the `start` event's `previous_reached` and `resumed_from`; the seconds
to redo them at the run's median step time), and the
seconds from the kill to the first new step logged in metrics.jsonl (process start, rendezvous,
restore, which is also given alone: `restore_s` of the `start` event). Saves are synchronous
(`checkpoint.async_save = false`) so that a kill always finds the step's checkpoint committed.

    python ops/bench/recovery_nodes.py --failures 4 --steps 40
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from recovery import records  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HARNESS = str(Path(sys.executable).with_name("harness"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def config(path: Path, args: argparse.Namespace) -> Path:
    """The run's config: the quickstart GPT at the benchmark's size, in exact elastic mode."""
    path.write_text(f"""
[model]
factory = "harness.models.gpt:build_gpt"
args = {{ n_layer = {args.layers}, n_head = 4, d_model = {args.d_model}, dropout = 0.1 }}
[data]
seq_len = 64
batch_size = 2
[optim]
type = "muon"
[train]
steps = {args.steps}
global_batch = 8
cpu_threads = 1
eval_every = 0
log_every = 1000
[checkpoint]
every_steps = {args.persistent_every}
async_save = false
""")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One run dir and its nodes' local folders; starts the nodes of a world and kills them."""

    def __init__(self, tmp: Path, name: str, cfg: Path, local_root: Path | None, local_every: int) -> None:
        self.run_dir, self.logs, self.cfg = tmp / name, tmp / f"{name}-logs", cfg
        self.locals = [local_root / f"{name}-node{i}" for i in range(2)] if local_root else None
        self.local_every, self.procs = local_every, []

    def _train(self, node: int) -> list[str]:
        cmd = ["train", str(self.cfg), "--run-dir", str(self.run_dir), "--set", f"log_dir='{self.logs}'"]
        if self.locals:
            cmd += ["--set", f"checkpoint.local.dir='{self.locals[node]}'",
                    "--set", f"checkpoint.local.every_steps={self.local_every}"]
        return cmd

    def start(self, world: int) -> None:
        if world == 1:
            self.procs = [subprocess.Popen([HARNESS, "--log-level", "warning", *self._train(0)], env=ENV,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
            return
        port = str(free_port())
        self.procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                        "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr",
                                        "127.0.0.1", "--master-port", port, "--max-restarts", "0", "--no-python",
                                        HARNESS, "--log-level", "warning", *self._train(node)],
                                       env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for node in range(2)]

    def kill(self) -> float:
        """SIGKILL every process of the run at once (torchrun starts each worker in a session of its
        own, so the tree is walked); the time of the kill."""
        procs = [p for proc in self.procs for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]]
        killed = time.time()
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for proc in self.procs:
            proc.wait(60)
        return killed

    def lose_disk(self, node: int) -> None:
        if self.locals:
            shutil.rmtree(self.locals[node], ignore_errors=True)

    def wait(self) -> None:
        for proc in self.procs:
            if proc.wait(1800) != 0:
                raise SystemExit(f"a node exited {proc.returncode}; logs in {self.logs}")

    def metrics(self) -> list[dict]:
        return [r for r in records(self.logs / "metrics.jsonl") if "loss" in r]

    def wait_step(self, step: int) -> None:
        while max((r["step"] for r in self.metrics()), default=0) < step:
            if any(proc.poll() not in (None, 0) for proc in self.procs):
                raise SystemExit(f"a node exited before step {step}; logs in {self.logs}")
            time.sleep(0.01)

    def wait_new_step(self, since: float) -> float:
        """The time of the first step logged after `since` (the kill)."""
        while True:
            new = [r["time"] for r in self.metrics() if r["time"] > since]
            if new:
                return min(new)
            if any(proc.poll() not in (None, 0) for proc in self.procs):
                raise SystemExit(f"a node exited after a restart; logs in {self.logs}")
            time.sleep(0.01)


def arm(run: Run, name: str, failures: list[int]) -> list[dict]:
    """Train with the arm's failures: one record per restart."""
    world, rows = 2, []
    run.start(world)
    for step in failures:
        run.wait_step(step)
        killed = run.kill()
        joins = name == "shrink" and world == 1
        if not joins:
            run.lose_disk(1)
        world = 1 if name == "shrink" and not joins else 2
        run.start(world)
        first = run.wait_new_step(killed)
        start = [e for e in records(run.logs / "events.jsonl") if e["event"] == "start"][-1]
        resumed = start["resumed_from"] or 0
        rows.append({"event": "node joins" if joins else "node lost", "world": f"{2 if not joins else 1} -> {world}",
                     "resumed_from": resumed, "tier": start["resumed_tier"],
                     "lost": (start["previous_reached"] or resumed) - resumed, "to_step_s": first - killed,
                     "restore_s": start["restore_s"]})
    run.wait()
    times = {r["step"]: r["time"] for r in run.metrics()}
    step_s = statistics.median(times[s] - times[s - 1] for s in times if s - 1 in times)
    return [{**r, "redo_s": r["lost"] * step_s} for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--failures", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--persistent-every", type=int, default=20)
    p.add_argument("--local-every", type=int, default=2)
    p.add_argument("--local-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    failures = sorted(random.Random(args.seed).sample(range(3, args.steps - 2), args.failures))
    print(f"failures after steps {failures}; {args.steps} steps; persistent every {args.persistent_every}, "
          f"local every {args.local_every} in {args.local_dir or 'a temporary folder'}; 2 nodes of 1 rank")
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=args.local_dir) as local:
        cfg = config(Path(tmp) / "run.toml", args)
        for name in ("replace", "shrink", "persistent"):
            run = Run(Path(tmp), name, cfg, None if name == "persistent" else Path(local), args.local_every)
            rows = arm(run, name, failures)
            for r in rows:
                print(f"  {name:<10} {r['event']:<10} ({r['world']}) resumed from {r['resumed_from']} ({r['tier']}): "
                      f"{r['lost']} steps lost, {r['to_step_s']:.2f} s from the kill to a new step "
                      f"(restore {r['restore_s']:.3f} s)")
            print(f"{name:<10} mean: {statistics.mean(r['lost'] for r in rows):.1f} steps lost "
                  f"({statistics.mean(r['redo_s'] for r in rows):.1f} s to redo them), "
                  f"{statistics.mean(r['to_step_s'] for r in rows):.2f} s to a new step, "
                  f"restore {statistics.mean(r['restore_s'] for r in rows):.3f} s")


if __name__ == "__main__":
    main()
