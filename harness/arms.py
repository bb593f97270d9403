"""`harness sweep CONFIG...`: train several experiment arms one after another.

Each arm is `harness train CONFIG [--set ...]` in a child process under the auto-retry
`Supervisor` (harness/supervisor.py), so one arm's crash ends that arm, not the sweep, and the
restarts and give-ups land in the arm's own events file, where `harness compare` counts them.
Running the same sweep again is how it resumes: an arm whose run is finished exits at once
("run already finished"), an interrupted one resumes from its newest good checkpoint.

Before anything trains, every config is loaded and validated (a typo in the last arm fails in
a second, not after hours) and the arms' run dirs must differ (two arms in one run dir would
resume each other). A stop signal (SIGTERM, SIGINT, SIGUSR1) is forwarded to the arm that is
training; that arm saves and exits 75 (PREEMPTED) and the sweep stops with its code instead of
starting the next arm, so a requeued sweep continues where it was.

Exit code: 0 when every arm finished; the requeue code of a preempted arm; else the code of the
first arm that failed (2 user error, 3 gave up), after the remaining arms were run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from harness.config import RunConfig, load_config
from harness.errors import UserError
from harness.events import EventLog
from harness.run.files import events_url
from harness.exit_codes import FINISHED, NAMES, REQUEUE
from harness.supervisor import Supervisor, checkpoint_progress, describe_exit


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


def load_arms(configs: list[str], overrides: list[str]) -> list[RunConfig]:
    """Every arm's validated config; UserError for a bad config or a run dir used twice."""
    arms = [load_config(path, overrides) for path in configs]
    first: dict[str, str] = {}
    for path, cfg in zip(configs, arms):
        key = cfg.run_dir.rstrip("/")
        if key in first:
            raise UserError(f"{path} and {first[key]} both train in run_dir {cfg.run_dir}; give each "
                            f"arm its own run_dir (an --set run_dir=... applies to every arm)")
        first[key] = path
    return arms


def sweep(configs: list[str], overrides: list[str], *, max_restarts: int = 0,
          crash_loop_limit: int = 3) -> list[ArmResult]:
    """Train each arm in turn; stops early only after a requeue (stop-signal) exit."""
    arms = load_arms(configs, overrides)
    results = []
    for path, cfg in zip(configs, arms):
        storage = cfg.checkpoint.storage_options or None
        progress = checkpoint_progress(cfg.run_dir, storage)
        before = progress()
        print(f"== arm {path} -> {cfg.run_dir}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "harness.cli", "train", path]
        for item in overrides:
            cmd += ["--set", item]
        code = Supervisor(cmd, max_restarts=max_restarts, crash_loop_limit=crash_loop_limit,
                          progress=progress, events=EventLog(events_url(cfg.run_dir, cfg.log_dir))).run()
        skipped = before is not None and before >= cfg.train.steps
        results.append(ArmResult(path, cfg.run_dir, code, skipped))
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
