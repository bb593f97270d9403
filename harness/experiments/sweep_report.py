"""`harness compare` over seeds and learning rates: the tables and the plot of grouped runs.

Tables (Markdown; grouping and the best lr: harness/experiments/seed_groups.py):
- by lr: one row per arm and lr: the seeds, and mean ± std [min, max] of the final eval loss,
  the mean best eval loss, steps/s and optimizer share; `*` marks the arm's best lr, `unfinished or NaN`
  a group with a run that did not count.
- best lr: one row per arm at its best lr: mean, std and min-max of final and best eval loss,
  mean (min-max) steps/s and optimizer share (% of step time), and whether the best lr is at
  the edge of the arm's grid (then the optimum may lie outside it).
- with `--target-loss X`, both gain "steps to X": mean (min-max) over seeds of the step at
  which the eval loss first reaches X (interpolated between evaluations; seed_groups.steps_to),
  the speed measure that still separates arms whose final losses meet at the data's floor.

The plot (PNG, two panels): each arm's mean eval loss against the step at its best lr, with the
band between its seeds' min and max; and each arm's mean final eval loss against the lr (log
axis; bars: min-max over seeds; the best lr ringed).
"""

from __future__ import annotations

from harness.experiments.comparison import markdown_table, save_two_panels
from harness.experiments.seed_groups import Arm, SeedGroup, Spread, final_eval, steps_to


def _best_eval(r):
    return r.best_eval


def _steps_per_s(r):
    return r.steps_per_s


def _optim_pct(r):
    return None if r.optim_share is None else 100 * r.optim_share


def _lr(g: SeedGroup) -> str:
    return "-" if g.lr is None else format(g.lr, "g")


def _seeds(g: SeedGroup) -> str:
    return ",".join(map(str, g.seeds))


def _mean(s: Spread | None, fmt: str) -> str:
    return "-" if s is None else format(s.mean, fmt)


def _full(s: Spread | None, fmt: str) -> str:
    return "-" if s is None else f"{s.mean:{fmt}} ± {s.std:{fmt}} [{s.min:{fmt}}, {s.max:{fmt}}]"


def _range(s: Spread | None, fmt: str) -> str:
    return "-" if s is None else f"{s.min:{fmt}}-{s.max:{fmt}}"


def _to_target(g: SeedGroup, target: float) -> str:
    s = g.spread(steps_to(target))
    if not g.counted:
        return "-"
    return "not reached" if s is None else f"{s.mean:.0f} ({s.min:.0f}-{s.max:.0f})"


def format_by_lr(arms: list[Arm], target: float | None = None) -> str:
    rows = [["arm", "lr key", "lr", "seeds", "final eval mean ± std [min, max]", "best eval", "steps/s", "optim %"]
            + ([f"steps to {target:g}"] if target is not None else [])]
    for a in arms:
        best = a.best
        for g in a.groups:
            final = g.spread(final_eval)
            rows.append([a.name, a.lr_key or "-", _lr(g) + (" *" if g is best else ""), _seeds(g),
                         _full(final, ".4f") if final else "unfinished or NaN", _mean(g.spread(_best_eval), ".4f"),
                         _mean(g.spread(_steps_per_s), ".2f"), _mean(g.spread(_optim_pct), ".1f")]
                        + ([_to_target(g, target)] if target is not None else []))
    return markdown_table(rows)


def format_best(arms: list[Arm], target: float | None = None) -> str:
    rows = [["arm", "optimizer", "best lr", "seeds", "final eval", "std", "min-max", "best eval", "std",
             "min-max", "steps/s (min-max)", "optim % (min-max)", "at grid edge"]
            + ([f"steps to {target:g} (min-max)"] if target is not None else [])]
    for a in arms:
        g = a.best
        if g is None:
            rows.append([a.name, a.optimizer, "-", "-", "every lr unfinished or NaN"] + ["-"] * (len(rows[0]) - 5))
            continue
        final, best, sps, opt = (g.spread(m) for m in (final_eval, _best_eval, _steps_per_s, _optim_pct))
        assert final is not None  # the best group is one with a final eval spread (Arm.best)
        rows.append([a.name, a.optimizer, _lr(g), _seeds(g), _mean(final, ".4f"), f"{final.std:.4f}",
                     _range(final, ".4f"), _mean(best, ".4f"), "-" if best is None else f"{best.std:.4f}",
                     _range(best, ".4f"), f"{_mean(sps, '.2f')} ({_range(sps, '.2f')})",
                     f"{_mean(opt, '.1f')} ({_range(opt, '.1f')})", "yes" if a.best_at_edge else "no"]
                    + ([_to_target(g, target)] if target is not None else []))
    return markdown_table(rows)


def eval_band(g: SeedGroup) -> list[tuple[int, float, float, float]]:
    """(step, mean, min, max) of the eval loss over the group's runs, at steps every run evaluated."""
    per_run = [{step: loss for step, _, loss in r.evals} for r in g.runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    out = []
    for step in steps:
        values = [p[step] for p in per_run]
        out.append((step, sum(values) / len(values), min(values), max(values)))
    return out


def write_sweep_plot(arms: list[Arm], path: str) -> None:
    """Best-lr eval curves with seed bands, and final eval loss vs lr per arm; a PNG at `path`."""

    def draw(curves, by_lr) -> None:
        for i, a in enumerate(arms):
            color = f"C{i % 10}"
            best = a.best
            if best is not None:
                band = eval_band(best)
                steps = [b[0] for b in band]
                curves.fill_between(steps, [b[2] for b in band], [b[3] for b in band], color=color, alpha=0.2, lw=0)
                curves.plot(steps, [b[1] for b in band], color=color, lw=1.5,
                            label=f"{a.name} (lr {_lr(best)}, {len(best.runs)} seeds)")
            points = [(g.lr, s) for g in a.groups if g.lr is not None and (s := g.spread(final_eval))]
            if points:
                xs, spreads = [p[0] for p in points], [p[1] for p in points]
                by_lr.errorbar(xs, [s.mean for s in spreads], yerr=[[s.mean - s.min for s in spreads],
                                                                    [s.max - s.mean for s in spreads]],
                               color=color, marker="o", ms=4, capsize=3, lw=1.2, label=a.name)
            if best is not None and best.lr is not None:
                best_final = best.spread(final_eval)
                assert best_final is not None  # the best group is one with a final eval spread (Arm.best)
                by_lr.plot([best.lr], [best_final.mean], marker="o", ms=11, mfc="none", color=color)
        curves.set(xlabel="step", ylabel="eval loss (mean; band: min-max over seeds)",
                   title="each arm at its best lr")
        by_lr.set(xlabel="lr of the arm's optimizer (log)", ylabel="final eval loss (mean; bars: min-max)",
                  title="final eval loss vs lr (ringed: best)", xscale="log")
        for ax in (curves, by_lr):
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)

    save_two_panels(path, draw)
