"""ops/gpu_check.py cannot rot unseen on machines without a GPU: its plan and arguments, and its
in-process checks (ops/gpu_probes.py) run on the host (`--device cpu`: the same saves, hash, finite
check and load, tiny sizes; the copy counts are zero there). The checks that start GPU runs are
SKIPPED here, saying why; they run in ops/gpu_check.sh on a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from procs import ENV, ROOT

SCRIPT = ROOT / "ops" / "gpu_check.py"
PROBES = ["async_save", "blocking_events", "hash_and_finite", "resume_read"]


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)


def test_the_dry_run_plans_every_check_for_one_gpu_and_for_two():
    proc = gpu_check("--dry-run")
    assert proc.returncode == 0, proc.stderr
    plans = proc.stdout.split("total")
    assert "ddp_swapped          needs 2 GPUs: SKIPPED" in plans[0] and "exact_elastic_fsdp   ~" in plans[1]
    for name in ("cublas_and_repeat", "kill_resume", "cpu_host_checkpoint", "torchrun_cpu", "ranks_beyond_gpus",
                 *PROBES, "suite_gpu_cases"):
        assert name in plans[0] and name in plans[1]


def test_bad_arguments_are_refused_naming_the_fix():
    unknown = gpu_check("--only", "async_save,nope", "--dry-run")
    assert unknown.returncode == 2 and "unknown check(s) ['nope']" in unknown.stderr
    ring = gpu_check("--state-mib", "128", "--staging-mib", "128", "--dry-run")
    assert ring.returncode == 2 and "--staging-mib must be at least 64 and under --state-mib" in ring.stderr


def test_the_in_process_checks_pass_on_the_host_and_the_gpu_runs_say_skip(tmp_path: Path):
    proc = gpu_check("--device", "cpu", "--only", ",".join([*PROBES, "kill_resume"]), "--state-mib", "96",
                     "--staging-mib", "64", "--model-args", "{ n_layer = 1, n_head = 2, d_model = 32 }",
                     "--work", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert [line.split(":")[0] for line in lines] == [
        "SKIP kill_resume", "PASS async_save", "SKIP blocking_events", "PASS hash_and_finite", "PASS resume_read"]
    assert "needs 1 GPU(s), 0 visible" in lines[0]
    recorded = {r["name"]: r for r in json.loads((tmp_path / "gpu-check.json").read_text())}
    save = recorded["async_save"]["figures"]
    assert save["ring_mib"] == 64 and save["host_allocator_growth_mib"] == 0 and save["grown_ring_mib"] > 96
    assert recorded["hash_and_finite"]["figures"]["finite_syncs"] == 0  # no device: nothing to wait for
    assert "figures:" in proc.stdout and "all passed" in proc.stdout
