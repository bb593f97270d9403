"""`harness compare RUN_DIR... [--plot out.png]`: a table of arms and a plot of their loss curves.

A RUN_DIR without run.json whose subfolders have one (a grid's sweep dir, `harness sweep
--grid`) stands for those runs. When some runs differ only by seed or only by lr, the runs are
grouped (harness/experiments/seed_groups.py) and reported by harness/experiments/sweep_report.py instead: mean and
spread over seeds, each arm's best lr; the per-run table below is for one run per arm. Only
the seed and where and how a run logs and saves may differ within a group: runs on other data,
model, device or evaluation are other rows, and two runs of one seed are never averaged.

Everything is computed from each run's files alone: `run.json` in the run dir (its config: the
arm's optimizer, its log dir, the tokens of one step) and, in the log dir, `metrics.jsonl` and
`events.jsonl`. Definitions of the columns (the test recomputes each from the files):

| column        | definition |
|---------------|------------|
| steps         | largest `step` of a training line (a line with `loss`) |
| final eval    | `eval_loss` of the last evaluation line in the file (the end-of-run one when finished) |
| best eval     | smallest `eval_loss` in the file |
| tokens/s      | median of the training lines' `tokens_per_s` (the median, because a shared machine stalls a few      |
|               | steps for seconds)                                                                                   |
| steps/s       | (grouped report) tokens/s / tokens per step |
| optim %       | 100 * sum(`optim_s`) / sum(step seconds), over training lines; step seconds = tokens per step /      |
|               | `tokens_per_s`, tokens per step = batch_size * seq_len * grad_accum                                  |
| ckpt s        | seconds the step loop was blocked by checkpoints (`harness.records.goodput`: sum of     |
|               | `blocking_s`)                                                                           |
| restart s     | restarting + recomputing seconds of `harness.records.goodput` (backoff, startup of      |
|               | resumed processes, steps run twice)                                                     |
| wall s        | wall clock of the run (`harness.records.goodput`) |

The plot (matplotlib, Agg backend; `pip install 'harness[plot]'`) has two panels: training loss
(faint) and eval loss (markers) against the step, and the same against wall-clock minutes since
the run's first event. A run that was interrupted and resumed keeps only the metrics of the
steps it kept (see `harness.records.metrics`), so its curve has a gap in time but none in steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import UserError
from harness.records.events import read_events
from harness.records.goodput import account
from harness.records.metrics import read_metrics
from harness.records.run_files import events_url, metrics_url, read_run_json
from harness.records.run_id import RUN_JSON

PLOT_SIZE_IN = (12.0, 4.5)
PLOT_DPI = 100  # with PLOT_SIZE_IN: a 1200 x 450 pixel PNG


@dataclass
class ArmSummary:
    """One row of the table, plus the curves for the plot."""

    name: str
    run_dir: str
    optimizer: str
    steps: int
    final_eval: float | None
    best_eval: float | None
    tokens_per_s: float | None
    steps_per_s: float | None  # tokens_per_s / tokens of one step
    optim_share: float | None  # fraction of step time in the optimizer part
    checkpoint_s: float
    restart_s: float
    wall_s: float
    config: dict = field(repr=False)  # run.json's config
    train: list[tuple[int, float, float]] = field(repr=False)  # (step, seconds since start, loss)
    evals: list[tuple[int, float, float]] = field(repr=False)  # (step, seconds since start, eval loss)


def run_dirs_of(given: str) -> list[str]:
    """[given] for a run dir (or anything else: summarize names what is missing); for a local
    folder without run.json, its subfolders that have one (a sweep dir), sorted."""
    folder = Path(given)
    if (folder / RUN_JSON).is_file() or not folder.is_dir():
        return [given]
    runs = sorted(str(sub) for sub in folder.iterdir() if (sub / RUN_JSON).is_file())
    return runs or [given]


def summarize(run_dir: str) -> ArmSummary:
    """Read one run's run.json, metrics and events into a table row; UserError if missing."""
    config = read_run_json(run_dir)
    metrics_path = Path(metrics_url(run_dir, config.get("log_dir")))
    if not metrics_path.is_file():
        raise UserError(f"no metrics file at {metrics_path} for run {run_dir}: has it trained a step on "
                        "this machine? (metrics stay in the local log dir)")
    records = read_metrics(metrics_path)
    events_path = Path(events_url(run_dir, config.get("log_dir")))
    events = read_events(events_path) if events_path.is_file() else []
    goodput = account(events)

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    start = min([float(e["time"]) for e in events[:1]] + [float(r["time"]) for r in train[:1]], default=0.0)
    data, steps_cfg = config.get("data", {}), config.get("train", {})
    # With train.global_batch the config's batch_size x grad_accum may not be what ran (one is derived).
    samples_per_step = steps_cfg.get("global_batch") or data.get("batch_size", 0) * steps_cfg.get("grad_accum", 1)
    tokens_per_step = samples_per_step * data.get("seq_len", 0)
    rated = [r for r in train if r.get("tokens_per_s")]
    timed = [r for r in rated if r.get("optim_s") is not None]  # runs from before optim_s have none
    step_s = sum(tokens_per_step / r["tokens_per_s"] for r in timed)
    # An eval line has no time of its own; it follows the training line of its step.
    time_at = {r["step"]: float(r["time"]) - start for r in train}

    tokens_per_s = statistics.median(r["tokens_per_s"] for r in rated) if rated else None
    return ArmSummary(
        name=run_dir.rstrip("/").rsplit("/", 1)[-1],
        run_dir=run_dir,
        optimizer=config.get("optim", {}).get("type", "adamw"),
        steps=max((r["step"] for r in train), default=0),
        final_eval=evals[-1]["eval_loss"] if evals else None,
        best_eval=min((r["eval_loss"] for r in evals), default=None),
        tokens_per_s=tokens_per_s,
        steps_per_s=tokens_per_s / tokens_per_step if tokens_per_s and tokens_per_step else None,
        optim_share=sum(r["optim_s"] for r in timed) / step_s if step_s else None,
        checkpoint_s=goodput.saving_s,
        restart_s=goodput.restarting_s + goodput.recompute_s,
        wall_s=goodput.wall_s,
        config=config,
        train=[(r["step"], float(r["time"]) - start, r["loss"]) for r in train],
        evals=[(r["step"], time_at.get(r["step"], 0.0), r["eval_loss"]) for r in evals],
    )


COLUMNS = ("arm", "optimizer", "steps", "final eval", "best eval", "tokens/s", "optim %",
           "ckpt s", "restart s", "wall s")


def table_cells(a: ArmSummary) -> list[str]:
    """The row as printed; numbers rounded for reading (the ArmSummary keeps them exact)."""
    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    return [a.name, a.optimizer, str(a.steps), num(a.final_eval, ".4f"), num(a.best_eval, ".4f"),
            num(a.tokens_per_s, ".0f"), num(None if a.optim_share is None else 100 * a.optim_share, ".1f"),
            num(a.checkpoint_s, ".2f"), num(a.restart_s, ".2f"), num(a.wall_s, ".1f")]


def format_table(arms: list[ArmSummary]) -> str:
    """A Markdown table (readable in a terminal, pasteable into docs)."""
    return markdown_table([list(COLUMNS)] + [table_cells(a) for a in arms])


def markdown_table(rows: list[list[str]]) -> str:
    """Rows of cells (the first: the header) as a Markdown table with aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_plot(arms: list[ArmSummary], path: str) -> None:
    """Two panels, loss vs step and loss vs wall minutes, one colour per arm; a PNG at `path`."""
    import matplotlib.ticker

    def draw(by_step, by_time) -> None:
        for i, a in enumerate(arms):
            color = f"C{i % 10}"
            for ax, x in ((by_step, 0), (by_time, 1)):
                scale = 1.0 if x == 0 else 1 / 60
                ax.plot([p[x] * scale for p in a.train], [p[2] for p in a.train], color=color, alpha=0.3, lw=0.8)
                ax.plot([p[x] * scale for p in a.evals], [p[2] for p in a.evals], color=color, marker="o",
                        ms=3, lw=1.5, label=a.name)
        by_step.set(xlabel="step", ylabel="loss (faint: train, markers: eval)", title="loss vs step")
        by_time.set(xlabel="wall clock (minutes)", title="loss vs wall time")
        for ax in (by_step, by_time):
            ax.set_yscale("log")  # the first steps' loss is several times the end's
            for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis(matplotlib.ticker.FormatStrFormatter("%.1f"))
            ax.grid(alpha=0.3, which="both")
        by_step.legend(fontsize=8)

    save_two_panels(path, draw)


def save_two_panels(path: str, draw: Callable[[Any, Any], None]) -> None:
    """A PNG at `path` (PLOT_SIZE_IN at PLOT_DPI) of two side-by-side panels that `draw(left,
    right)` fills (matplotlib Axes)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; also the only backend a batch node has
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=PLOT_SIZE_IN, dpi=PLOT_DPI)
    try:
        draw(left, right)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
