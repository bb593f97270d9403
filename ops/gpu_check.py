"""Interrupted vs continuous on CUDA: the GPU half of the exact-resume guarantee, in one go.

For each case (optimizer arm x precision) it trains the tiny config on `cuda` straight through,
then again with a SIGKILL at a random step after the first checkpoint and a restart, and
compares the final checkpoints (`harness ckpt diff`) and the per-step losses. Deterministic
cuBLAS (CUBLAS_WORKSPACE_CONFIG) and the CUDA RNG of every device are part of what is checked.
Then it runs the first case a second time from scratch (two fresh runs must agree bit for bit)
and checks the numerical settings the harness recorded in run.json (harness/repro/numerics.py).
Then, with two or more GPUs, FSDP (`parallel.strategy = "fsdp"`, torchrun, NCCL, 2 ranks) in
fp32 and with bf16 gathered parameters: the whole group SIGKILLed after the first checkpoint and
the same command again, against a continuous run (skipped, and said so, on one GPU: NCCL needs a
device per rank). Prints one line per case and exits non-zero if any differs. Run through
ops/gpu_check.sh.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))

import torch  # noqa: E402

from launch import kill_tree, run, start, tail, torchrun, wait_step  # noqa: E402
from procs import TINY, assert_same_run, harness, kill_at_step  # noqa: E402

CASES = {
    "adamw-fp32": ["--set", "optim.type=adamw"],
    "muon-fp32": ["--set", "optim.type=muon"],
    "muon-bf16": ["--set", "optim.type=muon", "--set", "train.precision=bf16"],
    "adafactor-fp16": ["--set", "optim.type=adafactor", "--set", "train.precision=fp16"],
    "olion-workers": ["--set", "optim.type=olion", "--set", "data.num_workers=2"],
}
FSDP_CASES = {
    "fsdp-fp32": ["--set", "parallel.strategy=fsdp"],
    "fsdp-bf16": ["--set", "parallel.strategy=fsdp", "--set", "parallel.param_dtype=bf16"],
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
        failures += report(name, t0, work)
    failures += check_repeatable_and_recorded(Path(tempfile.mkdtemp(prefix="gpu-check-repeat-")))
    failures += check_fsdp(rng)
    return 1 if failures else 0


def check_fsdp(rng: random.Random) -> int:
    """FSDP at world size 2 on two GPUs: a SIGKILL of the whole group, then the same command."""
    if torch.cuda.device_count() < 2:
        print(f"{'fsdp':16s} skipped: {torch.cuda.device_count()} GPU(s), FSDP over NCCL needs 2", flush=True)
        return 0
    failures = 0
    for name, extra in FSDP_CASES.items():
        t0 = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-"))

        def args(run_dir: Path, extra: list[str] = extra) -> list[str]:
            return torchrun("train", str(TINY), "--run-dir", str(run_dir), "--set", "train.device=cuda", *extra)

        log = work / "torchrun.log"
        ok = run(args(work / "continuous"), log) == 0
        proc = start(args(work / "interrupted"), log)
        wait_step(proc, work / "interrupted", rng.randrange(5, STEPS), log)
        kill_tree(proc.pid)
        proc.wait(60)
        ok = ok and run(args(work / "interrupted"), log) == 0
        failures += report(name, t0, work, None if ok else f"a run failed: {tail(log)[-500:]}")
    return failures


def report(name: str, t0: float, work: Path, failed: str | None = None) -> int:
    """Print the case's line (continuous vs interrupted under `work`); 1 when it differs."""
    try:
        assert failed is None, failed
        assert_same_run(work / "continuous", work / "interrupted", STEPS)
        verdict = "bitwise equal"
    except AssertionError as e:
        verdict = f"DIFFERS: {str(e).splitlines()[0]}"
    print(f"{name:16s} {verdict}  ({time.monotonic() - t0:.1f} s)", flush=True)
    return 0 if verdict == "bitwise equal" else 1


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
