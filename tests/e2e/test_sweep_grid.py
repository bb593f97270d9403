"""`harness sweep --grid/--seeds`: expansion into named runs and their overrides, bad grids refused
before anything starts, printed commands and the SLURM array, and a real sweep SIGKILLed in a
run: its finished run is not run again, the killed one resumes, and the result is bitwise an
uninterrupted run's. Then `harness compare` on the sweep dir groups it."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

import procs
from harness import cli
from harness.config import load_config
from harness.errors import UserError
from harness.experiments.arms import plan
from harness.experiments.grid import expand, parse_axes

TINY = procs.TINY


def test_grid_expands_seed_major_with_names_from_the_varied_values():
    axes = parse_axes(["optim.lr=1e-3,3e-3", "optim.warmup=2,4"], "0,1")
    points = expand(axes)
    assert [p.name for p in points] == [
        "lr=1e-3_warmup=2_seed=0", "lr=1e-3_warmup=4_seed=0", "lr=3e-3_warmup=2_seed=0", "lr=3e-3_warmup=4_seed=0",
        "lr=1e-3_warmup=2_seed=1", "lr=1e-3_warmup=4_seed=1", "lr=3e-3_warmup=2_seed=1", "lr=3e-3_warmup=4_seed=1"]
    assert points[5].assignments == ("optim.lr=1e-3", "optim.warmup=4", "train.seed=1")
    # Two keys with one last part are named in full; strings lose their quotes in the name.
    named = expand(parse_axes(["optim.lr=1e-3", "x.lr=2", 'optim.schedule="wsd","cosine"'], None))
    assert [p.name for p in named] == ["optim.lr=1e-3_x.lr=2_schedule=wsd", "optim.lr=1e-3_x.lr=2_schedule=cosine"]
    assert [p.name for p in expand([])] == [""]


def test_plan_puts_each_point_under_the_arms_run_dir_with_its_values(tmp_path):
    runs = plan([str(TINY)], [f'run_dir="{tmp_path}/sweep"', "train.steps=6"],
                parse_axes(["optim.lr=1e-3,2e-3"], "3,4"))
    assert [r.cfg.run_dir for r in runs] == [f"{tmp_path}/sweep/{n}" for n in
                                            ("lr=1e-3_seed=3", "lr=2e-3_seed=3", "lr=1e-3_seed=4", "lr=2e-3_seed=4")]
    assert [(r.cfg.optim.lr, r.cfg.train.seed, r.cfg.train.steps) for r in runs] == [
        (1e-3, 3, 6), (2e-3, 3, 6), (1e-3, 4, 6), (2e-3, 4, 6)]
    # The printed command trains exactly the planned config.
    cmd = runs[3].command(["harness"])
    assert cmd[:3] == ["harness", "train", str(TINY)]
    assert load_config(cmd[2], cmd[4::2]) == runs[3].cfg


@pytest.mark.parametrize("grid, seeds, needle", [
    (["optim.lr"], None, "expected KEY=V1,V2"),
    (["=1,2"], None, "expected KEY=V1,V2"),
    (["optim.lr=1e-3,,2e-3"], None, "an empty value"),
    (["optim.lr=1e-3,1e-3"], None, "1e-3 is listed twice"),
    (["optim.lr=1e-3", "optim.lr=2e-3"], None, "optim.lr is given twice"),
    (["train.seed=1"], "0,1", "train.seed is given twice"),
    ([], "0,x", "'x' is not an integer"),
    (["run_dir=a,b"], None, "every grid point gets its own run_dir"),
    (["optim.lr=[1]"], None, "must be a number"),
    (["optim.lr_muon=0.1,0.2"], None, "optim.lr_muon: unknown key for optim.type = 'adamw'"),
    (["optim.lrr=0.1"], None, "optim.lrr: unknown key"),
    (["optim.lr=-1"], None, "optim.lr: Input should be greater than 0"),
])
def test_a_bad_grid_is_one_line_exit_2_and_nothing_starts(tmp_path, capsys, grid, seeds, needle):
    args = ["sweep", str(TINY), "--set", f'run_dir="{tmp_path}/sweep"', *(a for g in grid for a in ("--grid", g))]
    assert cli.main([*args, *(["--seeds", seeds] if seeds else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "sweep").exists()


def test_a_bad_grid_from_the_shell(tmp_path):
    """The same in a real process: one line, exit 2, no traceback."""
    proc = procs.harness("sweep", str(TINY), "--set", f'run_dir="{tmp_path}/sweep"', "--grid", "optim.lrr=0.1,0.2")
    procs.assert_one_line_error(proc, "optim.lrr: unknown key")
    assert not (tmp_path / "sweep").exists()


def test_print_commands_and_slurm_array(tmp_path, capsys):
    base = [str(TINY), "--set", f'run_dir="{tmp_path}/s"', "--grid", "optim.lr=1e-3,2e-3", "--seeds", "0,1,2"]
    assert cli.main(["sweep", *base, "--print-commands"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6
    assert lines[0] == (f"harness train {TINY} --set 'run_dir=\"{tmp_path}/s\"' --set optim.lr=1e-3 "
                        f"--set train.seed=0 --set 'run_dir=\"{tmp_path}/s/lr=1e-3_seed=0\"'")
    assert cli.main(["sweep", *base, "--launcher", "slurm", "--max-restarts", "2"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --array=0-5\n" in script
    # Task 4 of the array runs the fifth printed command; bash (not SLURM) expands the array here.
    task = subprocess.run(["bash", "-c", script.replace('eval "exec ', 'echo "')], env={"SLURM_ARRAY_TASK_ID": "4"},
                          capture_output=True, text=True, check=True).stdout.strip()
    assert task == lines[4] + " --max-restarts 2 --backoff-initial 1.0"
    assert not (tmp_path / "s").exists()


def test_sweep_killed_mid_run_skips_finished_and_resumes_exactly(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = ["sweep", str(TINY), "--set", f'run_dir="{sweep_dir}"', "--grid", "optim.lr=1e-3,2e-3", "--seeds", "1"]
    first, second = sweep_dir / "lr=1e-3_seed=1", sweep_dir / "lr=2e-3_seed=1"
    # SIGKILL the sweep process itself once the second run is past its first checkpoint (step 4).
    proc = procs.start(*args)
    procs.wait_for_step(proc, second, 6)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert procs.last_step(second) < 12 and procs.last_step(first) == 12
    first_files = {p: p.read_bytes() for p in (first / "metrics.jsonl", first / "events.jsonl")}

    again = procs.harness(*args, check=True)
    assert "lr=1e-3_seed=1: finished at step 12, skipped" in again.stderr
    assert "lr=2e-3_seed=1 -> " in again.stderr and "(resuming from step" in again.stderr
    assert {p: p.read_bytes() for p in first_files} == first_files  # not run again, not even started
    assert [e["event"] for e in procs.events(second)].count("start") == 2

    # The killed run ends where a run never interrupted ends, bit for bit.
    reference = tmp_path / "reference"
    procs.harness("train", str(TINY), "--set", "optim.lr=2e-3", "--set", "train.seed=1",
                  "--set", f'run_dir="{reference}"', check=True)
    procs.assert_same_run(second, reference, 12)

    # compare reads the sweep dir as its runs: one arm over two lrs, one seed each.
    table = procs.harness("compare", str(sweep_dir), check=True).stdout
    rows = [line for line in table.splitlines() if line.startswith("| sweep ")]
    assert len(rows) == 3 and "| optim.lr | 0.001 " in rows[0] and "| optim.lr | 0.002 " in rows[1], table


def test_grid_keys_are_validated_for_every_arm(tmp_path):
    muon = tmp_path / "muon.toml"
    muon.write_text(f'extends = "{TINY}"\nrun_dir = "{tmp_path}/muon"\n[optim]\ntype = "muon"\n')
    with pytest.raises(UserError, match="optim.lr_muon: unknown key for optim.type = 'adamw'"):
        plan([str(muon), str(TINY)], [], parse_axes(["optim.lr_muon=0.01,0.02"], None))
    assert not Path(tmp_path / "muon").exists()
