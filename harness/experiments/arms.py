"""`harness sweep CONFIG... [--grid KEY=V1,V2 ...] [--seeds S1,S2]`: train experiment arms, and
grids of runs over config keys, one after another on this machine, or print them for a cluster.

Without a grid each CONFIG (an arm) is one run in its own run_dir. With `--grid`/`--seeds`
(harness/experiments/grid.py) each CONFIG's run_dir becomes the sweep dir of that arm and every grid point
one run under it, `RUN_DIR/lr=3e-3_seed=0`, trained with the point's values as `--set` items.

Each run is `harness train CONFIG --set ...` in a child process under the auto-retry
`Supervisor` (harness/process/supervisor.py), so one run's crash ends that run, not the sweep, and the
restarts and give-ups land in the run's own events file, where `harness compare` counts them.
Running the same sweep again is how it resumes: a run whose newest good checkpoint is its
finished final one is skipped without starting a process, an interrupted one resumes from its
newest good checkpoint (a SIGKILLed sweep takes its training child with it: PR_SET_PDEATHSIG).

Before anything trains, every run's config is loaded and validated (a typo or an unknown grid
key fails in a second, not after hours) and the run dirs must differ (two runs in one run dir
would resume each other). A stop signal (SIGTERM, SIGINT, SIGUSR1) is forwarded to the run that
is training; that run saves and exits 75 (PREEMPTED) and the sweep stops with its code instead
of starting the next, so a requeued sweep continues where it was.

`--print-commands` prints one `harness train` command per run instead of training;
`--launcher slurm` prints a SLURM array job (one task per run, `sbatch` it), whose tasks resume
and skip like the local sweep, since each is the same `harness train` command.

Exit code: 0 when every run finished; the requeue code of a preempted run; else the code of the
first run that failed (2 user error, 3 gave up), after the remaining runs were run.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from harness.config import RunConfig, load_config
from harness.config_layers import toml_string
from harness.errors import UserError
from harness.exit_codes import FINISHED, NAMES, REQUEUE
from harness.experiments.grid import Axis, expand
from harness.process.supervisor import Supervisor, checkpoint_progress, describe_exit
from harness.records.events import EventLog
from harness.records.run_files import events_url


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: `harness train CONFIG --set ...` with its validated config."""

    config: str  # the arm's TOML path
    name: str  # the grid point's name ("" without a grid)
    overrides: tuple[str, ...]  # --set items: the sweep's, the grid point's, its run_dir
    cfg: RunConfig

    @property
    def label(self) -> str:
        return f"{self.config} {self.name}" if self.name else self.config

    def command(self, program: list[str]) -> list[str]:
        """`PROGRAM train CONFIG --set ...` (PROGRAM: how `harness` is started)."""
        return [*program, "train", self.config, *(arg for item in self.overrides for arg in ("--set", item))]


@dataclass
class ArmResult:
    config: str
    run_dir: str
    exit_code: int
    skipped: bool  # the run was already finished before the sweep started it

    @property
    def outcome(self) -> str:
        if self.skipped and self.exit_code == FINISHED:
            return "skipped (already finished)"
        return NAMES.get(self.exit_code, describe_exit(self.exit_code))


def plan(configs: list[str], overrides: list[str], axes: Sequence[Axis] = ()) -> list[PlannedRun]:
    """Every run of the sweep, each config validated; UserError for a bad config, an unknown
    grid key or a run dir used twice. Without axes, one run per config in its own run_dir; with
    them, one run per grid point under `RUN_DIR/POINT_NAME` of each config (and its log_dir, if
    set, under the config's)."""
    points = expand(list(axes))
    runs = []
    for path in configs:
        base = load_config(path, overrides)
        for point in points:
            items = [*overrides, *point.assignments]
            if point.name:
                items.append(f"run_dir={toml_string(base.run_dir.rstrip('/') + '/' + point.name)}")
                if base.log_dir:
                    items.append(f"log_dir={toml_string(base.log_dir.rstrip('/') + '/' + point.name)}")
            runs.append(PlannedRun(path, point.name, tuple(items), load_config(path, items)))
    first: dict[str, str] = {}
    for run in runs:
        key = run.cfg.run_dir.rstrip("/")
        if key in first:
            raise UserError(f"{run.label} and {first[key]} both train in run_dir {run.cfg.run_dir}; give each "
                            f"arm its own run_dir (an --set run_dir=... applies to every arm)")
        first[key] = run.label
    return runs


def finished(cfg: RunConfig) -> tuple[int | None, bool]:
    """(step of the newest good checkpoint or None, whether it is the finished run's)."""
    from harness.checkpoint import CheckpointStore  # torch: not needed to print commands

    store = CheckpointStore(cfg.run_dir, storage_options=cfg.checkpoint.storage_options or None)
    ref = store.latest_good()
    if ref is None:
        return None, False
    # Whether a run finished is its trainer part's to say (harness.run.state.TrainerCounters).
    return ref.step, ref.step >= cfg.train.steps and bool(store.open(ref).state["parts"]["trainer"]["finished"])


def sweep(runs: list[PlannedRun], *, max_restarts: int = 0, crash_loop_limit: int = 3,
          backoff_initial: float = 1.0) -> list[ArmResult]:
    """Train each run in turn, skipping finished ones without starting a process; stops early
    only after a requeue (stop-signal) exit."""
    results = []
    for run in runs:
        cfg = run.cfg
        step, done = finished(cfg)
        if done:
            print(f"== {run.label}: finished at step {step}, skipped", file=sys.stderr, flush=True)
            results.append(ArmResult(run.label, cfg.run_dir, FINISHED, True))
            continue
        storage = cfg.checkpoint.storage_options or None
        print(f"== {run.label} -> {cfg.run_dir}" + (f" (resuming from step {step})" if step else ""),
              file=sys.stderr, flush=True)
        code = Supervisor(run.command([sys.executable, "-m", "harness.cli"]), max_restarts=max_restarts,
                          crash_loop_limit=crash_loop_limit, backoff_initial=backoff_initial,
                          progress=checkpoint_progress(cfg.run_dir, storage),
                          events=EventLog(events_url(cfg.run_dir, cfg.log_dir))).run()
        results.append(ArmResult(run.label, cfg.run_dir, code, False))
        if code in REQUEUE:
            break
    return results


def exit_code(results: list[ArmResult]) -> int:
    for r in results:
        if r.exit_code in REQUEUE:
            return r.exit_code
    return next((r.exit_code for r in results if r.exit_code != FINISHED), FINISHED)


def format_summary(results: list[ArmResult]) -> str:
    width = max(len(r.config) for r in results)
    lines = [f"{r.config:<{width}}  {r.outcome:<28}{r.run_dir}" for r in results]
    return "sweep:\n" + "\n".join("  " + line for line in lines)


def command_lines(runs: list[PlannedRun]) -> list[str]:
    """One shell line per run: `harness train CONFIG --set ...`, quoted for sh."""
    return [shlex.join(run.command(["harness"])) for run in runs]


def slurm_array(runs: list[PlannedRun], *, max_restarts: int, backoff_initial: float = 1.0) -> str:
    """A SLURM array job running run i as task i (edit its #SBATCH lines for the cluster)."""
    restart = ["--max-restarts", str(max_restarts), "--backoff-initial", str(backoff_initial)]
    lines = [shlex.join(run.command(["harness"]) + restart) for run in runs]
    body = "\n".join(f"  {shlex.quote(line)}" for line in lines)
    return f"""#!/usr/bin/env bash
# `harness sweep` as a SLURM array job: task i trains run i ({len(runs)} runs). Submit from the
# directory the sweep was planned in: mkdir -p logs && sbatch THIS_FILE. Submitting it again (or
# requeueing a task) resumes: a finished run exits at once, an interrupted one resumes.
#SBATCH --job-name=harness-sweep
#SBATCH --array=0-{len(runs) - 1}
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%A_%a.out
#SBATCH --open-mode=append
#SBATCH --requeue
set -uo pipefail
RUNS=(
{body}
)
eval "exec ${{RUNS[$SLURM_ARRAY_TASK_ID]}}"
"""
