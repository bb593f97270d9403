"""`harness status RUN_DIR`: one screen for a running or stopped run, from its logs alone.

Step / total steps, tokens/s and the time per step over the last steps logged, ETA, the newest
committed checkpoint and its age, processes and supervisor restarts, goodput so far
(harness.records.goodput), the last anomaly and the last hang, and whether the run is stopped (its last
process wrote an `exit` event) or running (or was killed: the age of its last record says which).
The command (`--watch [SECONDS]` redraws until Ctrl-C) is harness/cli/status.py.

Reads only the log dir (events.jsonl, and the tail of metrics.jsonl: a long run's metrics are
large), never the checkpoints, so it is cheap to run against a live run on any storage.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from harness.errors import UserError
from harness.records.events import EVENTS_FILE, read_events
from harness.records.goodput import account, describe_resumes
from harness.records.jsonlines import parse_line

METRICS_TAIL_BYTES = 256 * 1024  # the last few hundred steps of metrics.jsonl
RECENT_STEPS = 20


def render(run_dir: str, log_dir: Path, now: float | None = None) -> str:
    """The status screen of the run whose logs are in `log_dir`."""
    now = time.time() if now is None else now
    events_path = log_dir / EVENTS_FILE
    if not events_path.exists():
        raise UserError(f"no events file at {events_path}: is {run_dir} the run dir of a `harness train` run "
                        f"started on this machine? (pass --log-dir when its config sets log_dir)")
    events = read_events(events_path)
    steps = [r for r in tail_records(log_dir / "metrics.jsonl") if "loss" in r]
    g = account(events)
    starts = [e for e in events if e.get("event") == "start"]
    total = next((e["total_steps"] for e in reversed(starts) if "total_steps" in e), None)
    step = steps[-1]["step"] if steps else g.last_step or 0
    recent = steps[-RECENT_STEPS:]
    speed = [r["tokens_per_s"] for r in recent if isinstance(r.get("tokens_per_s"), (int, float))]
    gaps = [b["time"] - a["time"] for a, b in zip(recent, recent[1:], strict=False) if b["step"] == a["step"] + 1]
    step_s = statistics.median(gaps) if gaps else None
    last_event = events[-1] if events else {}
    stopped = last_event.get("event") in ("exit", "gave_up")

    lines = [f"run {run_dir}"]
    progress = f"step {step}/{total}" if total else f"step {step}"
    if total:
        progress += f" ({100 * step / total:.1f} %)"
    lines.append(f"  {progress}")
    if stopped:
        code = last_event.get("exit_code")
        name = last_event.get("reason") or last_event.get("event")
        lines.append(f"  state       stopped: {name}" + (f" (exit {code})" if code is not None else ""))
    else:
        age = now - max(float(last_event.get("time", 0.0)), float(steps[-1]["time"]) if steps else 0.0)
        lines.append(f"  state       running, or killed: last record {format_age(age)} ago")
    lines.append(f"  speed       {statistics.mean(speed):,.0f} tokens/s" if speed else "  speed       -")
    if step_s is not None:
        eta = f", ETA {format_age((total - step) * step_s)}" if total and not stopped and step < total else ""
        lines.append(f"  step time   {step_s:.3g} s (median of the last {len(gaps)}){eta}")
    committed = [e for e in events if e.get("event") == "committed"]
    if committed:
        c = committed[-1]
        lines.append(f"  checkpoint  step {c['step']}, committed {format_age(now - c['time'])} ago")
    else:
        lines.append("  checkpoint  none committed yet")
    lines.append(f"  processes   {g.processes}, {g.restarts} supervisor restart(s); goodput {100 * g.goodput:.1f} %")
    if g.resumes:
        lines.append(f"  last resume {describe_resumes(g.resumes[-1:])}")
    anomalies = [e for e in events if e.get("event") == "anomaly"]
    if anomalies:
        a = anomalies[-1]
        action = f"rolled back to step {a['to_step']}" if a.get("action") == "rollback" else "stopped the run"
        lines.append(f"  anomaly     step {a['step']}: {a['cause']} ({a['value']}), {action}; "
                     f"{len(g.rollbacks)} rollback(s) in all")
    hangs = [e for e in events if e.get("event") == "hang"]
    if hangs:
        h = hangs[-1]
        lines.append(f"  hang        step {h['step']} in {h['phase']} (limit {h['limit_s']:.0f} s), "
                     f"{format_age(now - h['time'])} ago; stacks: {h['stacks']}")
    return "\n".join(lines)


def tail_records(path: Path, limit: int = METRICS_TAIL_BYTES) -> list[dict]:
    """The JSON-object lines in the last `limit` bytes of `path` (the first, partial one dropped)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - limit))
        raw = f.read().splitlines()
    if size > limit:
        raw = raw[1:]
    return [r for r in map(parse_line, raw) if r is not None and isinstance(r.get("step"), int)]


def format_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"

