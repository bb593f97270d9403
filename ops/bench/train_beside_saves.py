"""A real `harness train` run's steps beside its background saves, under two values of one setting,
in the same run of this script: by default the writer placed (`checkpoint.writer_cores = "auto"`)
and on any core; `--compare train.host_heap=keep,system` compares the kept heap with glibc's.

The quickstart GPT at `--d-model`/`--layers` with AdamW (the default: 302M parameters, 3.4 GiB of
parameters and moments), batches of 2 x `--seq-len` tokens, `train.cpu_threads=1` (a core left
for the writer on the 2-core reference machine), a background save every `--every` steps. For
each run, from its metrics.jsonl (each step's end time) and events.jsonl (each save's
`checkpoint` and `committed` times, and its blocking seconds, taken off the step after it): the
steps that ran while a save persisted against the steps that did not, leaving out the first two
(warm-up). The two values alternate over `--rounds` rounds, each run's ratio taken against its
own steps; the figure is the median of the per-run ratios with their range, and for each value the
median step without a save and the runs' peak RSS.

    python ops/bench/train_beside_saves.py [--d-model 1024 --layers 24] [--seq-len 8] [--steps 21] [--every 5]
                                           [--rounds 3] [--compare KEY=A,B]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.toml"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(run_dir: Path, args: argparse.Namespace, setting: str) -> dict:
    """One training run with `setting` (KEY=VALUE); its start event's writer cores and heap, its steps
    beside a persist and not beside one, its peak RSS."""
    cmd = [sys.executable, "-m", "harness.cli", "--log-level", "warning", "train", str(CONFIG),
           "--run-dir", str(run_dir), "--set", f"train.steps={args.steps}", "--set", "train.cpu_threads=1",
           "--set", f"checkpoint.every_steps={args.every}", "--set", "checkpoint.keep_last=2",
           "--set", setting, "--set", "train.eval_every=0",
           "--set", f"model.args.d_model={args.d_model}", "--set", f"model.args.n_layer={args.layers}",
           "--set", "model.args.n_head=8", "--set", "model.args.dropout=0.0", "--set", "data.batch_size=2",
           "--set", f"data.seq_len={args.seq_len}",
           "--set", "optim.type=adamw", "--set", "optim.lr_muon=null"]
    # Its stderr to a file, not a pipe: nothing reads a pipe while wait4 waits (a full one would stall the run).
    stderr = run_dir.with_suffix(".stderr")
    with stderr.open("w") as err, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err) as proc:
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage: its peak RSS
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{setting}: harness train failed: {stderr.read_text()[-2000:]}")
    events, metrics = lines(run_dir / "events.jsonl"), lines(run_dir / "metrics.jsonl")
    start = next(e for e in events if e["event"] == "start")
    saves = {e["step"]: e for e in events if e["event"] == "checkpoint"}
    committed = {e["step"]: e["time"] for e in events if e["event"] == "committed"}
    persists = [(saves[s]["time"], committed[s]) for s in saves if s in committed]
    ends = {m["step"]: m["time"] for m in metrics if "loss" in m}
    beside, alone = [], []
    for step in sorted(ends)[2:]:
        if step - 1 not in ends:
            continue
        # A step after a save starts with its blocking part (the `checkpoint` event's blocking_s).
        t0 = ends[step - 1] + (saves[step - 1]["blocking_s"] if step - 1 in saves else 0.0)
        t1 = ends[step]
        (beside if any(a < t1 and t0 < b for a, b in persists) else alone).append(t1 - t0)
    return {"cores": start.get("writer_cores"), "heap": start.get("host_heap"), "beside": beside, "alone": alone,
            "peak_rss_gib": usage.ru_maxrss / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=8, help="tokens per sample (a step of about 2 s on one core)")
    p.add_argument("--steps", type=int, default=21)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compare", default="checkpoint.writer_cores=auto,any", help="KEY=A,B: the two values compared")
    args = p.parse_args()
    key, _, values = args.compare.partition("=")
    settings = [f"{key}={v}" for v in values.split(",")]
    results: dict[str, list[dict]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="train-beside-saves-", dir=ROOT / "runs" if (ROOT / "runs").is_dir()
                                     else None) as work:
        for r in range(args.rounds):
            for setting in settings if r % 2 == 0 else reversed(settings):
                got = run(Path(work) / f"{setting}-{r}", args, setting)
                results[setting].append(got)
                print(f"round {r + 1}, {setting} (writer cores {got['cores']}, heap {got['heap']}): "
                      f"{len(got['beside'])} steps beside a save, median {statistics.median(got['beside']):.3f} s; "
                      f"{len(got['alone'])} without, median {statistics.median(got['alone']):.3f} s; "
                      f"peak RSS {got['peak_rss_gib']:.2f} GiB", flush=True)
    for setting, runs in results.items():
        ratios = [statistics.median(x["beside"]) / statistics.median(x["alone"]) for x in runs]
        print(f"{setting}: a step beside a background save / a step without = "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) over {len(runs)} runs "
              f"(goal <= 1.05x); a step without a save {statistics.median(x for r in runs for x in r['alone']):.3f} s; "
              f"peak RSS {max(r['peak_rss_gib'] for r in runs):.2f} GiB")


if __name__ == "__main__":
    main()
