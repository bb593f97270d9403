"""The local checkpoint tier at world size 2 (DDP, gloo, launch.Ranks): each rank keeps its own
local folder; after a SIGKILL of the whole group the ranks agree on the newest step both hold and
resume from it, bitwise equal to the continuous run (tests/distributed/conftest.py)."""


from harness.checkpoint.discovery import STEP_DIR
from helpers import flip_byte
from launch import kill_all, run, start, tail, train_args, wait_step
from procs import assert_same_run, events

STEPS = 12


def killed_group(tmp_path) -> tuple:
    """A world-size-2 run with local checkpoints every 2 steps (persistent at 10 and 12), its
    whole group SIGKILLed after step 7: (run dir, local folder of the run, its args, log)."""
    run_dir, local, log = tmp_path / "run", tmp_path / "local", tmp_path / "torchrun.log"
    args = train_args(run_dir, "--set", "checkpoint.every_steps=10", "--set", f"checkpoint.local.dir='{local}'",
                      "--set", "checkpoint.local.every_steps=2")
    proc = start(args, log)
    wait_step(proc, run_dir, 7, log)
    kill_all(proc)
    proc.wait(60)
    (run_folder,) = local.iterdir()
    return run_dir, run_folder, args, log


def steps_of(rank_folder) -> list[int]:
    """The committed steps of a rank's local folder (not the temporary folder of a save the kill cut short:
    local saves run in the background, so one may be in flight)."""
    folders = (STEP_DIR.fullmatch(p.name) for p in (rank_folder / "checkpoints").iterdir())
    return sorted(int(m[1]) for m in folders if m)


def test_group_sigkill_resumes_from_the_local_tier_bitwise(tmp_path, continuous):
    run_dir, run_folder, args, log = killed_group(tmp_path)
    newest = min(steps_of(run_folder / "rank-00000")[-1], steps_of(run_folder / "rank-00001")[-1])
    assert run(args, log) == 0, tail(log)
    last_start = events(run_dir, "start")[-1]
    assert (last_start["resumed_from"], last_start["resumed_tier"]) == (newest, "local")
    assert newest >= 6
    assert_same_run(continuous, run_dir, STEPS)


def test_ranks_agree_on_a_step_every_rank_holds(tmp_path, continuous):
    """Rank 1's newest local checkpoint is damaged (a flipped byte): it is rejected (by whichever
    of the two ranks sharing the folder verified it; reported in rank 0's events) and both ranks
    resume from the older step they share."""
    run_dir, run_folder, args, log = killed_group(tmp_path)
    rank1 = run_folder / "rank-00001"
    held = steps_of(rank1)
    assert len(held) == 2, held
    model = rank1 / "checkpoints" / f"step-{held[-1]:08d}" / "model.safetensors"
    flip_byte(model, at=-9, mask=0x10)
    assert run(args, log) == 0, tail(log)
    last_start = events(run_dir, "start")[-1]
    assert (last_start["resumed_from"], last_start["resumed_tier"]) == (held[0], "local")
    (rejected,) = events(run_dir, "checkpoint_rejected")
    assert (rejected["owner"], rejected["step"]) == (1, held[-1]) and "model.safetensors" in rejected["problem"]
    assert_same_run(continuous, run_dir, STEPS)


def test_local_auto_interval_is_rank_0s_on_every_rank(tmp_path):
    """`checkpoint.local.every_steps = "auto"` at world size 2: each rank times its own saves and
    steps, rank 0's decision is taken by both, so both ranks save (and keep) the same local steps."""
    run_dir, local, log = tmp_path / "run", tmp_path / "local", tmp_path / "torchrun.log"
    args = train_args(run_dir, "--set", "checkpoint.every_steps=10", "--set", f"checkpoint.local.dir='{local}'",
                      "--set", 'checkpoint.local.every_steps="auto"', "--set", "checkpoint.local.keep=20",
                      "--set", "checkpoint.mtbf_hours=0.0001")
    assert run(args, log) == 0, tail(log)
    (choice,) = events(run_dir, "checkpoint_interval")
    assert choice["tier"] == "local"
    (run_folder,) = local.iterdir()
    saved = steps_of(run_folder / "rank-00000")
    assert saved[0] == 1 and saved == steps_of(run_folder / "rank-00001")
