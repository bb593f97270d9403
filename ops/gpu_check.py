"""Interrupted vs continuous on CUDA: the GPU half of the exact-resume guarantee, in one go.

For each case (optimizer arm x precision) it trains the tiny config on `cuda` straight through,
then again with a SIGKILL at a random step after the first checkpoint and a restart, and
compares the final checkpoints (`harness ckpt diff`) and the per-step losses. Deterministic
cuBLAS (CUBLAS_WORKSPACE_CONFIG) and the CUDA RNG of every device are part of what is checked.
Then it runs the first case a second time from scratch (two fresh runs must agree bit for bit)
and checks the numerical settings the harness recorded in run.json (harness/numerics.py).
Prints one line per case and exits non-zero if any differs. Run through ops/gpu_check.sh.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from procs import TINY, assert_same_run, harness, kill_at_step  # noqa: E402

CASES = {
    "adamw-fp32": ["--set", "optim.type=adamw"],
    "muon-fp32": ["--set", "optim.type=muon"],
    "muon-bf16": ["--set", "optim.type=muon", "--set", "train.precision=bf16"],
    "adafactor-fp16": ["--set", "optim.type=adafactor", "--set", "train.precision=fp16"],
    "olion-workers": ["--set", "optim.type=olion", "--set", "data.num_workers=2"],
}
STEPS = 12


def main() -> int:
    failures = 0
    rng = random.Random(0)
    for name, extra in CASES.items():
        t0 = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-"))
        args = ["train", str(TINY), "--set", "train.device=cuda", *extra]
        harness(*args, "--run-dir", str(work / "continuous"), check=True)
        kill_at_step([*args, "--run-dir", str(work / "interrupted")], work / "interrupted", rng.randrange(5, STEPS))
        harness(*args, "--run-dir", str(work / "interrupted"), check=True)
        try:
            assert_same_run(work / "continuous", work / "interrupted", STEPS)
            verdict = "bitwise equal"
        except AssertionError as e:
            failures += 1
            verdict = f"DIFFERS: {str(e).splitlines()[0]}"
        print(f"{name:16s} {verdict}  ({time.monotonic() - t0:.1f} s)", flush=True)
    failures += check_repeatable_and_recorded(Path(tempfile.mkdtemp(prefix="gpu-check-repeat-")))
    return 1 if failures else 0


def check_repeatable_and_recorded(work: Path) -> int:
    """Two fresh runs of one config agree, and run.json records the CUDA determinism settings."""
    args = ["train", str(TINY), "--set", "train.device=cuda", *CASES["muon-bf16"]]
    for name in ("first", "second"):
        harness(*args, "--run-dir", str(work / name), check=True)
    problems = []
    try:
        assert_same_run(work / "first", work / "second", STEPS)
    except AssertionError as e:
        problems.append(f"two fresh runs differ: {str(e).splitlines()[0]}")
    numerics = json.loads((work / "first" / "run.json").read_text())["environment"]["numerics"]
    cuda = numerics.get("cuda", {})
    expected = {"deterministic_algorithms": numerics.get("deterministic_algorithms"),
                "cudnn_benchmark off": cuda.get("cudnn_benchmark") is False,
                "cudnn_deterministic": cuda.get("cudnn_deterministic"),
                "CUBLAS_WORKSPACE_CONFIG": numerics["env"].get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"}
    problems += [f"run.json: {k} not in force" for k, ok in expected.items() if not ok]
    print(f"{'repeat+settings':16s} {'; '.join(problems) or 'two fresh runs bitwise equal, settings recorded'}"
          f"  ({json.dumps(cuda)})", flush=True)
    return len(problems)


if __name__ == "__main__":
    sys.exit(main())
