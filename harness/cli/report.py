"""`harness report RUN_DIR`: the run's goodput (where its wall-clock time went), from its events."""

from __future__ import annotations

import argparse
from typing import Any

from harness.errors import UserError
from harness.records.events import read_events
from harness.records.goodput import Goodput, account, describe_resumes
from harness.records.run_files import events_url, refuse_a_file


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("report", help="print a run's goodput: training, saving, "
                                             "restarting, recomputing", description=__doc__)
    p.add_argument("run_dir", help="the run dir (URL) given to `harness train`")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    refuse_a_file(args.run_dir)
    url = events_url(args.run_dir)
    try:
        events = read_events(url)
    except FileNotFoundError:
        raise UserError(f"no events file at {url}: is {args.run_dir} the run dir of a "
                        "`harness train` run started on this machine?") from None
    print(format_report(args.run_dir, account(events)))
    return 0


def format_report(run_dir: str, g: Goodput) -> str:
    def row(name: str, seconds: float, note: str = "") -> str:
        share = 100 * seconds / g.wall_s if g.wall_s > 0 else 0.0
        return f"  {name:<20}{seconds:>12.1f} s{share:>8.1f} %  {note}".rstrip()

    return "\n".join([
        f"run {run_dir}: {g.processes} process(es), {g.restarts} supervisor restart(s), "
        f"last step {g.last_step}, last exit {g.exit_reason or 'none (crashed or running)'}",
        row("training", g.training_s, "productive steps"),
        row("saving (blocking)", g.saving_s),
        row("restarting", g.restarting_s, "backoff + startup of resumed processes"),
        row("recomputing", g.recompute_s, f"{g.recompute_steps} step(s) lost and re-run"),
        row("other", g.other_s, "eval, logging, data stalls, untracked gaps"),
        row("wall clock", g.wall_s),
        f"  goodput {100 * g.goodput:.1f} %",
        *([f"  without the local tier: goodput {100 * g.goodput_without_local:.1f} % at most "
           f"({g.extra_steps_without_local} more step(s) re-run, {g.local_saving_s:.1f} s of local saves not spent)"]
          if g.goodput_without_local is not None else []),
        *([f"  rollbacks: {len(g.rollbacks)} ({describe_rollbacks(g.rollbacks)})"] if g.rollbacks else []),
        *([f"  resumes: {describe_resumes(g.resumes)}"] if g.resumes else []),
    ])


def describe_rollbacks(rollbacks: list[dict[str, Any]]) -> str:
    """"step 7 -> 4, skipped batch 7; ..." from `anomaly` events with action "rollback"."""
    def one(r: dict[str, Any]) -> str:
        skip = r.get("skip") or []
        batches = "batches" if len(skip) > 1 else "batch"
        what = f"skipped {batches} {', '.join(map(str, skip))}" if skip else "nothing skipped"
        return f"step {r['step']} -> {r['to_step']}, {what}"

    return "; ".join(one(r) for r in rollbacks)
