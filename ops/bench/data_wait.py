"""Does the step wait on data? The share of each training step that `harness train` spends in
`next(batches)`, for the quickstart and the tokens example, with 0 and 2 loader workers.

The trainer times the wait for every micro-batch and records it per step in metrics.jsonl as
`data_s` (harness/run/trainer.py: `StepResult.data_seconds`); the step's own time is
tokens / `tokens_per_s`. Each contender is a fresh `harness train` process of `--steps` steps
(evaluation off, no checkpoint inside the timed steps); the figures are over the steps after
`--warmup` (the first batches open the epoch: the permutation, the loader's worker start-up, the
first shard opens). The tokens example trains on shards prepared here first, as the README says
(`harness data prepare builtin:corpus --tokenizer train-bpe:512`). Prints a Markdown table.

    python ops/bench/data_wait.py --steps 60 --warmup 10
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
sys.path.insert(0, str(ROOT))

from harness.config import batch_shape, load_config  # noqa: E402

CONFIGS = {"quickstart": ROOT / "configs" / "quickstart.toml",
           "tokens-example": ROOT / "configs" / "tokens-example.toml"}


def harness(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def settings(steps: int, workers: int, shards: Path | None) -> list[str]:
    overrides = [f"train.steps={steps}", "train.eval_every=0", f"checkpoint.every_steps={steps * 100}",
                 f"data.num_workers={workers}"]
    if shards is not None:
        overrides.append(f'data.sources=[{{url = "{shards}"}}]')
    return overrides


def measure(config: Path, overrides: list[str], warmup: int, run_dir: Path) -> dict:
    """Train once; the wait figures over the steps after `warmup`."""
    harness("train", str(config), "--run-dir", str(run_dir), *[a for o in overrides for a in ("--set", o)])
    cfg = load_config(config, overrides)
    batch_size, grad_accum = batch_shape(cfg, 1)
    tokens = batch_size * grad_accum * cfg.data.seq_len
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r and r["step"] > warmup]
    step_s = [tokens / r["tokens_per_s"] for r in steps]
    data_s = [r["data_s"] for r in steps]
    return {"steps": len(steps), "step_ms": 1e3 * statistics.median(step_s),
            "wait_share": sum(data_s) / sum(step_s), "wait_ms_median": 1e3 * statistics.median(data_s),
            "wait_ms_max": 1e3 * max(data_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--workers", default="0,2", help="data.num_workers values, comma-separated")
    parser.add_argument("--configs", default="quickstart,tokens-example")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "tokens-example"
        for name in args.configs.split(","):
            if name == "tokens-example" and not shards.exists():
                harness("data", "prepare", "builtin:corpus", "--out", str(shards), "--tokenizer", "train-bpe:512")
            for workers in map(int, args.workers.split(",")):
                overrides = settings(args.steps, workers, shards if name == "tokens-example" else None)
                figures = measure(CONFIGS[name], overrides, args.warmup, Path(tmp) / f"{name}-w{workers}")
                rows.append((name, workers, figures))
    print(f"steps {args.warmup + 1}..{args.steps} of each run (after {args.warmup} warm-up steps)\n")
    print("| config | num_workers | step, median | wait for data, share of step time | wait per step, median | max |")
    print("|---|---|---|---|---|---|")
    for name, workers, f in rows:
        print(f"| {name} | {workers} | {f['step_ms']:.1f} ms | {100 * f['wait_share']:.2f}% | "
              f"{f['wait_ms_median']:.3f} ms | {f['wait_ms_max']:.2f} ms |")


if __name__ == "__main__":
    main()
