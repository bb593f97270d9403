"""A resume reads the chosen checkpoint's small files once: `manifest.json` and `state.json` are
parsed once and passed down (loading.py), not re-read by every layer (each read is a GET on S3);
its tensor files twice: prefetched while the trainer is built (prefetch.py), then loaded.

Counted in a real `harness train` process by the fault layer in `count` mode, which records every
storage operation with its path (HARNESS_FAULTS_TRACE)."""

from __future__ import annotations

from harness.storage.faults import TRACE_ENV
from harness.storage.filesystem import FAULTS_ENV
from procs import ENV, TINY, harness


def test_a_resume_opens_the_candidates_manifest_and_state_once_and_prefetches_its_tensor_files(tmp_path):
    run, logs, trace = tmp_path / "run", tmp_path / "logs", tmp_path / "trace"
    args = ["train", str(TINY), "--run-dir", str(run), "--set", f"log_dir={logs}", "--set", "debug.step_sleep_s=0"]
    crashed = harness(*args, "--set", "debug.crash_at_step=5", "--set", "checkpoint.async_save=false")
    assert crashed.returncode != 0 and (run / "checkpoints" / "step-00000004" / "manifest.json").exists()

    harness(*args, check=True, env={**ENV, FAULTS_ENV: "count", TRACE_ENV: str(trace)})
    opened = [line.split(" ", 2)[2] for line in trace.read_text().splitlines() if line.split(" ", 2)[1] == "open"]
    candidate = "/checkpoints/step-00000004/"
    reads = {name: sum(path.endswith(candidate + name) for path in opened)
             for name in ("manifest.json", "state.json", "model.safetensors", "optim.safetensors")}
    # The tensor files: the prefetch's open, then the load's.
    assert reads == {"manifest.json": 1, "state.json": 1, "model.safetensors": 2, "optim.safetensors": 2}, opened
