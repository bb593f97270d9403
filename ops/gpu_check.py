"""The GPU checks (docs/gpu.md), in one go: one PASS / FAIL / SKIP line per check, then the figures;
exits 1 when a check failed. Run it through ops/gpu_check.sh on a machine with a CUDA build of torch.

Each check is a real run of what a first GPU session would hit (issue 74), named by the defect it
would catch:
  cublas_and_repeat   two fresh runs bitwise equal, run.json's CUDA settings in force; the harness
                      runs WITHOUT CUBLAS_WORKSPACE_CONFIG in its environment and must set it itself
  kill_resume         SIGKILL and resume against a continuous run, bitwise, on CUDA: dropout (the
                      rank's own GPU stream), muon bf16, adafactor fp16, exact mode with clipping
  cpu_host_checkpoint a checkpoint made where no GPU is visible (CUDA_VISIBLE_DEVICES="") resumed on
                      the GPU host with train.device = "cpu" (bitwise) and with "cuda" (resumes, warns)
  torchrun_cpu        2 ranks under torchrun with train.device = "cpu" on the GPU host: gloo, bitwise
                      the same run with no GPU visible
  ranks_beyond_gpus   2 ranks on CUDA where 1 GPU is visible: one line, exit 2, not a crash
  ddp_swapped         (2 GPUs) DDP at 2 ranks, dropout on, and FSDP with bf16 gathered parameters,
                      killed, resumed under a swapped CUDA_VISIBLE_DEVICES: bitwise the continuous run
  exact_elastic_fsdp  (2 GPUs) exact mode under FSDP with clipping: world 1 and world 2 bitwise equal;
                      killed at 2, resumed at 1 on the other GPU alone, killed, resumed at 2 swapped
  async_save, blocking_events, hash_and_finite, resume_read   in this process (ops/gpu_probes.py)
  suite_gpu_cases     the suite's own CUDA cases (HARNESS_TESTS_GPU=1 keeps the GPU visible to them)

On one GPU, ddp_swapped and exact_elastic_fsdp are SKIPPED, saying so: NCCL refuses two ranks on
one device (and the harness refuses them before NCCL: ranks_beyond_gpus), so the GPU all-reduce and
all-gather paths (DDP's, the exact clipping norm's under FSDP) and a rank's stream moving to another
device index need two. Everything else runs on one. `--device cpu` runs the in-process checks on the
host (the CPU smoke test: tests/ops/test_gpu_check.py); `--dry-run` prints the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "distributed"), str(ROOT / "ops")]

import gpu_probes  # noqa: E402
import torch  # noqa: E402
from gpu_probes import Result, verdict  # noqa: E402

from compare import bitwise_differences, losses_of  # noqa: E402
from harness.repro import numerics  # noqa: E402
from launch import Ranks, kill_all, run, start, tail, torchrun, wait_step  # noqa: E402
from procs import ENV, TINY, assert_same_run, events, harness  # noqa: E402

EXACT = ROOT / "tests" / "data" / "exact.toml"
CASES = {  # kill_resume's cases: (config, its steps, --sets)
    "adamw-fp32-dropout": (TINY, 12, ["--set", "optim.type=adamw"]),
    "muon-bf16": (TINY, 12, ["--set", "optim.type=muon", "--set", "train.precision=bf16"]),
    "adafactor-fp16": (TINY, 12, ["--set", "optim.type=adafactor", "--set", "train.precision=fp16"]),
    "exact-clipped": (EXACT, 8, ["--set", "train.grad_clip=0.5"]),
}
NO_CUBLAS = {k: v for k, v in ENV.items() if k != "CUBLAS_WORKSPACE_CONFIG"}


@dataclass
class Context:
    device: torch.device
    gpus: int
    work: Path
    state_mib: int
    staging_mib: int
    model_args: str
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    digests: dict = field(default_factory=dict)  # the async_save state's, for resume_read


@dataclass(frozen=True)
class Check:
    name: str
    gpus: int  # visible GPUs it needs (0: runs on the host too, in-process)
    seconds: int  # estimated for an H100 (docs/gpu.md): no GPU has run it yet
    run: Callable[[Context], Result]


def cuda_env(visible: str | None = None, base: dict[str, str] = ENV) -> dict[str, str]:
    env = dict(base)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def cublas_and_repeat(ctx: Context) -> Result:
    args = ["train", str(TINY), "--set", "train.device=cuda", *CASES["muon-bf16"][2]]
    for name in ("first", "second"):
        harness(*args, "--run-dir", str(ctx.work / "repeat" / name), check=True, env=NO_CUBLAS)
    problems = same_run(ctx.work / "repeat" / "first", ctx.work / "repeat" / "second", 12, "two fresh runs")
    numerics = json.loads((ctx.work / "repeat" / "first" / "run.json").read_text())["environment"]["numerics"]
    cuda = numerics.get("cuda", {})
    cublas = numerics["env"].get("CUBLAS_WORKSPACE_CONFIG")
    expected = {"CUBLAS_WORKSPACE_CONFIG set by the harness": cublas == ":4096:8",
                "deterministic_algorithms": numerics.get("deterministic_algorithms") is True,
                "cudnn_benchmark off": cuda.get("cudnn_benchmark") is False,
                "cudnn_deterministic": cuda.get("cudnn_deterministic") is True}
    problems += [f"run.json: {k} not in force" for k, ok in expected.items() if not ok]
    figures = {"caller_CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "cuda_numerics": cuda}
    return verdict("cublas_and_repeat", problems, figures, "two fresh runs bitwise equal; the harness set cuBLAS's "
                   "workspace itself; deterministic settings recorded")


def same_run(a: Path, b: Path, steps: int, what: str) -> list[str]:
    try:
        assert_same_run(a, b, steps)
    except AssertionError as e:
        return [f"{what} differ: {str(e).splitlines()[0]}"]
    return []


def interrupted(cmd: list[str] | Ranks, run_dir: Path, step: int, committed: int, log: Path,
                env: dict[str, str]) -> None:
    """Start `cmd`, SIGKILL it (every process) once `step` is logged and `committed` committed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = start(cmd, log, env)
    try:
        wait_step(proc, run_dir, step, log, committed=committed)
    finally:
        kill_all(proc)
        proc.wait(60)


def train_cmd(config: Path, run_dir: Path, *sets: str) -> list[str]:
    return [sys.executable, "-m", "harness.cli", "train", str(config), "--run-dir", str(run_dir), *sets]


def kill_resume(ctx: Context) -> Result:
    problems, figures = [], {}
    for name, (config, steps, sets) in CASES.items():
        t0, work = time.monotonic(), ctx.work / "kill" / name
        sets = [*sets, "--set", "train.device=cuda"]
        harness("train", str(config), "--run-dir", str(work / "continuous"), *sets, check=True)
        every = 2 if config == EXACT else 4
        at = ctx.rng.randrange(every + 1, steps)
        interrupted(train_cmd(config, work / "interrupted", *sets), work / "interrupted", at, every, work / "log",
                    ENV)
        harness("train", str(config), "--run-dir", str(work / "interrupted"), *sets, check=True)
        problems += same_run(work / "continuous", work / "interrupted", steps, f"{name} (killed after step {at})")
        figures[f"{name}_s"] = round(time.monotonic() - t0, 1)
    return verdict("kill_resume", problems, figures, f"{len(CASES)} cases bitwise equal after a SIGKILL")


def cpu_host_checkpoint(ctx: Context) -> Result:
    work, no_gpu = ctx.work / "cpu-host", cuda_env("")
    harness("train", str(TINY), "--run-dir", str(work / "continuous"), check=True, env=no_gpu)
    for name in ("on-cpu", "on-cuda"):
        interrupted(train_cmd(TINY, work / name), work / name, 5, 4, work / "log", no_gpu)
    problems = []
    resumed = harness("train", str(TINY), "--run-dir", str(work / "on-cpu"), "--set", "train.device=cpu")
    if resumed.returncode != 0:
        problems.append(f"resumed with train.device=cpu on the GPU host: exit {resumed.returncode}: "
                        f"{resumed.stderr.strip().splitlines()[-1:]}")
    else:
        problems += same_run(work / "continuous", work / "on-cpu", 12, "the CPU host's run and its GPU host resume")
    on_cuda = harness("train", str(TINY), "--run-dir", str(work / "on-cuda"), "--set", "train.device=cuda")
    if on_cuda.returncode != 0:
        problems.append(f"resumed with train.device=cuda: exit {on_cuda.returncode}: "
                        f"{on_cuda.stderr.strip().splitlines()[-1:]}")
    elif "device_type" not in on_cuda.stderr:
        problems.append("the resume on CUDA of a CPU checkpoint did not warn that the device type changed")
    return verdict("cpu_host_checkpoint", problems, {}, "resumed on the GPU host: bitwise on the CPU, warned on CUDA")


def torchrun_cpu(ctx: Context) -> Result:
    work, sets = ctx.work / "torchrun-cpu", ["--set", "train.device=cpu", "--set", "optim.type=muon"]
    work.mkdir(parents=True, exist_ok=True)
    codes = {}
    for name, env in (("gpu-host", cuda_env()), ("no-gpu", cuda_env(""))):
        codes[name] = run(torchrun("train", str(TINY), "--run-dir", str(work / name), *sets), work / f"{name}.log",
                          env=env)
    problems = [f"{name}: exit {code}: {tail(work / f'{name}.log')[-300:]}" for name, code in codes.items() if code]
    if not problems:
        if "backend=gloo" not in (work / "gpu-host.log").read_text():
            problems.append("the group on the GPU host did not join gloo")
        problems += same_run(work / "no-gpu", work / "gpu-host", 12, "train.device=cpu on the GPU host and without one")
    return verdict("torchrun_cpu", problems, {}, "gloo on the GPU host, bitwise the run without a GPU")


def ranks_beyond_gpus(ctx: Context) -> Result:
    log = ctx.work / "beyond.log"
    code = run(Ranks(("train", str(TINY), "--run-dir", str(ctx.work / "beyond"), "--set", "train.device=cuda")), log,
               env=cuda_env("0"))
    text = tail(log)
    problems = [] if code == 2 and "2 ranks on this node train on CUDA but it shows 1 GPU" in text \
        and "Traceback" not in text else [f"exit {code}: {text[-400:]}"]
    return verdict("ranks_beyond_gpus", problems, {}, "refused in one line, exit 2")


def ddp_swapped(ctx: Context) -> Result:
    """DDP (muon, dropout) and FSDP with bf16 gathered parameters, 2 ranks each: continuous under
    CUDA_VISIBLE_DEVICES=0,1, and killed there and resumed under 1,0; bitwise."""
    problems, figures = [], {}
    for name, sets in (("ddp", ("--set", "optim.type=muon")),
                       ("fsdp-bf16", ("--set", "parallel.strategy=fsdp", "--set", "parallel.param_dtype=bf16"))):
        work, log = ctx.work / name, ctx.work / f"{name}.log"

        def ranks(run_dir: str, work: Path = work, sets: tuple[str, ...] = sets) -> Ranks:
            return Ranks(("train", str(TINY), "--run-dir", str(work / run_dir), "--set", "train.device=cuda", *sets))

        codes = [run(ranks("continuous"), log, env=cuda_env("0,1"))]
        at = figures[f"{name}_killed_after"] = ctx.rng.randrange(5, 12)
        interrupted(ranks("interrupted"), work / "interrupted", at, 4, log, cuda_env("0,1"))
        codes.append(run(ranks("interrupted"), log, env=cuda_env("1,0")))
        problems += [f"{name}: a run exited {codes}: {tail(log)[-400:]}"] if any(codes) else \
            same_run(work / "continuous", work / "interrupted", 12, f"{name} killed after step {at}, resumed swapped,")
    return verdict("ddp_swapped", problems, figures, "DDP and FSDP (bf16) bitwise equal across the swap")


def exact_elastic_fsdp(ctx: Context) -> Result:
    work = ctx.work / "exact-fsdp"
    work.mkdir(parents=True)
    log = work / "log"
    sets = ("--set", "parallel.strategy=fsdp", "--set", "train.device=cuda", "--set", "train.grad_clip=0.5")

    def ranks(run_dir: str, world: int) -> Ranks:
        return Ranks(("train", str(EXACT), "--run-dir", str(work / run_dir), *sets), world)

    codes = [run(ranks("two", 2), log, env=cuda_env("0,1")), run(ranks("one", 1), log, env=cuda_env("1"))]
    interrupted(ranks("elastic", 2), work / "elastic", 3, 2, log, cuda_env("0,1"))
    interrupted(ranks("elastic", 1), work / "elastic", 5, 4, log, cuda_env("1"))
    codes.append(run(ranks("elastic", 2), log, env=cuda_env("1,0")))
    if any(codes):
        return verdict("exact_elastic_fsdp", [f"a run exited {codes}: {tail(log)[-400:]}"], {}, "")
    problems = [f"world 1 vs 2: {d}" for d in bitwise_differences(work / "one", work / "two", 8)]
    problems += [f"2 -> 1 -> 2 vs 2: {d}" for d in bitwise_differences(work / "two", work / "elastic", 8)]
    if losses_of(work / "one") != losses_of(work / "two") or losses_of(work / "two") != losses_of(work / "elastic"):
        problems.append("the logged losses differ")
    changes = [(e["old_world_size"], e["new_world_size"]) for e in events(work / "elastic", "world_size_changed")]
    if changes != [(2, 1), (1, 2)]:
        problems.append(f"world size changes {changes}")
    return verdict("exact_elastic_fsdp", problems, {}, "world 1 = world 2 = 2 -> 1 -> 2, bitwise, clipped")


def async_save(ctx: Context) -> Result:
    result, ctx.digests = gpu_probes.async_save(ctx.device, ctx.work / "probe", ctx.state_mib, ctx.staging_mib)
    return result


def resume_read(ctx: Context) -> Result:
    if not ctx.digests:
        return Result("resume_read", "SKIP", "needs async_save's checkpoint")
    return gpu_probes.resume_read(ctx.device, ctx.work / "probe", ctx.state_mib, ctx.digests)


def suite_gpu_cases(ctx: Context) -> Result:
    cases = ["tests/checkpoint/save/test_async_save.py::test_gpu_state_is_staged_in_pinned_buffers_on_a_side_stream",
             "tests/data/test_pipeline.py::test_batches_from_workers_come_pinned_for_a_cuda_device"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *cases],
                          cwd=ROOT, env={**ENV, "HARNESS_TESTS_GPU": "1"}, capture_output=True, text=True)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    problems = [] if proc.returncode == 0 and "skipped" not in last else [f"pytest: {last}"]
    return verdict("suite_gpu_cases", problems, {}, last)


CHECKS = [
    Check("cublas_and_repeat", 1, 25, cublas_and_repeat),
    Check("kill_resume", 1, 130, kill_resume),
    Check("cpu_host_checkpoint", 1, 60, cpu_host_checkpoint),
    Check("torchrun_cpu", 1, 50, torchrun_cpu),
    Check("ranks_beyond_gpus", 1, 10, ranks_beyond_gpus),
    Check("ddp_swapped", 2, 110, ddp_swapped),
    Check("exact_elastic_fsdp", 2, 100, exact_elastic_fsdp),
    Check("async_save", 0, 40, async_save),
    Check("blocking_events", 0, 5, lambda ctx: gpu_probes.blocking_events(ctx.device)),
    Check("hash_and_finite", 0, 20, lambda ctx: gpu_probes.hash_and_finite(ctx.device, TINY, ctx.work, ctx.model_args)),
    Check("resume_read", 0, 15, resume_read),
    Check("suite_gpu_cases", 1, 30, suite_gpu_cases),
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the in-process checks on the host (the others need a GPU and are skipped)")
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    p.add_argument("--state-mib", type=int, default=1024, help="async_save's device state (default 1 GiB)")
    p.add_argument("--staging-mib", type=int, default=192, help="async_save's ring (at least 64, under the state)")
    p.add_argument("--model-args", default=gpu_probes.MODEL_ARGS, help="hash_and_finite's GPT (model.args, TOML)")
    p.add_argument("--work", type=Path, help="where the runs go (default: a new temporary folder, removed if all pass)")
    p.add_argument("--dry-run", action="store_true", help="print the checks and their expected seconds, run nothing")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {c.name for c in CHECKS})
    if unknown:
        p.error(f"unknown check(s) {unknown}; the checks: {', '.join(c.name for c in CHECKS)}")
    if not 64 <= args.staging_mib < args.state_mib:
        p.error("--staging-mib must be at least 64 and under --state-mib (the ring streams the state)")
    args.checks = [c for c in CHECKS if not names or c.name in names]
    return args


def plan(checks: list[Check], gpus: int) -> list[str]:
    lines = [f"{c.name:20s} {'needs ' + str(c.gpus) + ' GPUs: SKIPPED' if gpus < c.gpus else f'~{c.seconds} s'}"
             for c in checks]
    total = sum(c.seconds for c in checks if gpus >= c.gpus)
    return [*lines, f"{'total':20s} ~{total} s on {gpus} GPU(s) (estimates for H100s: not measured yet)"]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if args.dry_run:  # without a GPU here: the plans of a machine with one and with two
        for count in [gpus] if gpus or device.type == "cpu" else [1, 2]:
            print("\n".join(plan(args.checks, count)))
        return 0
    if device.type == "cuda" and gpus == 0:
        print("FAIL preflight: no CUDA device visible", flush=True)
        return 1
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    numerics.prepare_environment()  # as the harness's CLI does first: the in-process checks run its code
    ctx = Context(device, gpus, work, args.state_mib, args.staging_mib, args.model_args)
    results = [run_check(check, ctx) for check in args.checks]
    print("figures:")
    for r in results:
        if r.figures:
            print(f"  {r.name}: {json.dumps(r.figures, default=str)}")
    (work / "gpu-check.json").write_text(json.dumps([r.__dict__ for r in results], default=str, indent=1))
    failed = any(r.status == "FAIL" for r in results)
    print(f"{'FAILED' if failed else 'all passed'}; the runs: {work}", flush=True)
    if not failed and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def run_check(check: Check, ctx: Context) -> Result:
    """One check's result, its line printed; a check that needs more GPUs than visible is skipped."""
    t0 = time.monotonic()
    if ctx.gpus < check.gpus:
        why = "NCCL needs a GPU per rank" if check.gpus > 1 else "needs a GPU"
        result = Result(check.name, "SKIP", f"needs {check.gpus} GPU(s), {ctx.gpus} visible ({why}; docs/gpu.md)")
    else:
        try:
            result = check.run(ctx)
        except Exception as e:  # a check that could not finish is a failure, said in its line
            result = Result(check.name, "FAIL", f"{type(e).__name__}: {str(e)[-600:]}")
    result.figures["seconds"] = round(time.monotonic() - t0, 1)
    print(f"{result.status} {result.name}: {result.detail}", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
