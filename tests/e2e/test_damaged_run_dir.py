"""A run dir whose every checkpoint is damaged: `harness train` refuses to start over (exit 2,
naming them) and changes nothing, unless told `--resume never` (real processes)."""

from helpers import flip_byte
from procs import TINY, assert_one_line_error, events, harness, kill_at_step


def snapshot(run) -> dict[str, bytes]:
    """Every file under the run dir but the lease, by relative path."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != "lease.json"}


def test_every_checkpoint_damaged_is_refused_and_kept(tmp_path):
    run = tmp_path / "run"
    # Saves inside the step loop: the kill after step 10 always finds steps 4 and 8 committed (a
    # background save still in flight at the kill, seen on a busy machine, left no step 8).
    sync = ["--set", "checkpoint.async_save=false"]
    assert kill_at_step(["train", str(TINY), "--run-dir", str(run), *sync], run, 10) != 0
    for step in (4, 8):
        model = run / "checkpoints" / f"step-{step:08d}" / "model.safetensors"
        flip_byte(model, at=-9, mask=0x10)
    before = snapshot(run)

    refused = harness("train", str(TINY), "--run-dir", str(run))
    assert_one_line_error(refused, "every checkpoint in")
    assert "(step-00000008, step-00000004;" in refused.stderr
    assert "--resume never" in refused.stderr
    assert snapshot(run) == before  # metrics, events, run.json and the damaged checkpoints untouched

    fresh = harness("train", str(TINY), "--run-dir", str(run), "--resume", "never", check=True)
    assert "Traceback" not in fresh.stderr
    start = [e for e in events(run) if e["event"] == "start"][-1]
    assert start["resumed_from"] is None
    assert harness("ckpt", "verify", str(run)).returncode == 0
