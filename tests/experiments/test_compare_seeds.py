"""`harness compare` over seeds and lrs, on constructed run dirs (run.json + metrics.jsonl as
`harness train` writes them): runs that differ only by seed are one group, groups that differ
only by lr one arm, the spread numbers are the ones computed here by hand, each arm's best lr
is its lowest mean final eval loss, a run that did not finish never wins, and the plot is a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import cli
from harness.experiments.comparison import summarize
from harness.experiments.seed_groups import group_runs, steps_to
from png import png_size

STEPS = 4
TOKENS = 8 * 16  # batch_size x seq_len


def _run(folder: Path, optim: dict, seed: int, evals: list[float], *, steps: int = STEPS,
         tokens_per_s: float = 256.0, optim_s: float = 0.125, data: dict | None = None,
         train: dict | None = None, checkpoint: dict | None = None) -> Path:
    """A run dir trained for `steps` steps, evaluated at 2 and 4 (`evals`), 0.5 s per step;
    `data`, `train` and `checkpoint` add keys to those config tables."""
    folder.mkdir(parents=True)
    config = {"run_dir": str(folder), "log_dir": None, "optim": optim,
              "data": {"batch_size": 8, "seq_len": 16, **(data or {})},
              "train": {"steps": STEPS, "seed": seed, "grad_accum": 1, **(train or {})},
              "checkpoint": {"every_steps": 2, **(checkpoint or {})}}
    (folder / "run.json").write_text(json.dumps({"run_id": f"r{seed}", "config": config}))
    lines = []
    for step in range(1, steps + 1):
        lines.append({"step": step, "loss": 3.0 - 0.1 * step, "tokens_per_s": tokens_per_s, "optim_s": optim_s,
                      "time": 100.0 + step})
        if step % 2 == 0:
            lines.append({"step": step, "eval_loss": evals[step // 2 - 1]})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


@pytest.fixture
def sweep(tmp_path):
    """adamw over 3 lrs x 2 seeds (2e-3 best), muon over 2 lrs x 3 seeds (its best, 0.04, has a
    lower mean than 0.02 only because 0.02 has a run that stopped at step 2), and an adamw with
    another weight decay: a third arm."""
    adamw = {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0}
    finals = {1e-3: (2.0, 2.2), 2e-3: (1.5, 1.8), 4e-3: (1.9, 1.6)}
    for lr, per_seed in finals.items():
        for seed, final in enumerate(per_seed):
            _run(tmp_path / "adamw" / f"lr={lr}_seed={seed}", {**adamw, "lr": lr}, seed, [final + 0.5, final],
                 tokens_per_s=256.0 * (1 + seed))
    muon = {"type": "muon", "lr": 3e-3, "lr_muon": 0.02}
    for seed, final in enumerate((1.0, 1.1, 1.2)):
        _run(tmp_path / "muon" / f"lr_muon=0.04_seed={seed}", {**muon, "lr_muon": 0.04}, seed, [final + 0.1, final],
             optim_s=0.25)
        _run(tmp_path / "muon" / f"lr_muon=0.02_seed={seed}", muon, seed, [0.5, 0.4], steps=2 if seed == 1 else STEPS)
    _run(tmp_path / "wd" / "seed=0", {**adamw, "weight_decay": 0.1}, 0, [2.5, 2.4])
    return tmp_path


def test_runs_group_by_seed_and_lr_and_the_best_lr_is_the_lowest_mean(sweep):
    runs = [summarize(str(d)) for arm in ("adamw", "muon", "wd") for d in sorted((sweep / arm).iterdir())]
    arms = {a.name: a for a in group_runs(runs)}
    assert set(arms) == {"adamw", "muon", "seed=0"}

    adamw = arms["adamw"]
    assert adamw.lr_key == "optim.lr" and [g.lr for g in adamw.groups] == [1e-3, 2e-3, 4e-3]
    assert [g.seeds for g in adamw.groups] == [[0, 1]] * 3
    assert adamw.best.lr == 2e-3 and not adamw.best_at_edge
    final = adamw.best.spread(lambda r: r.final_eval)
    assert (final.mean, final.min, final.max, final.n) == pytest.approx((1.65, 1.5, 1.8, 2))
    assert final.std == pytest.approx(((1.5 - 1.65) ** 2 + (1.8 - 1.65) ** 2) ** 0.5)  # sample std, n - 1 = 1
    best_eval = adamw.best.spread(lambda r: r.best_eval)
    assert best_eval.mean == pytest.approx(1.65)  # the eval before was 0.5 higher
    # steps/s = tokens/s / tokens per step: 2 and 4; optimizer share 0.125 s of 0.5 s, then of 0.25 s.
    assert adamw.best.spread(lambda r: r.steps_per_s).mean == pytest.approx(3.0)
    assert adamw.best.spread(lambda r: r.optim_share).max == pytest.approx(0.5)

    # Steps to an eval loss of 1.9: seed 0 goes 2.0 -> 1.5 from step 2 to 4, seed 1 2.3 -> 1.8.
    to_target = adamw.best.spread(steps_to(1.9))
    assert (to_target.min, to_target.max) == pytest.approx((2 + 2 * 0.1 / 0.5, 2 + 2 * 0.4 / 0.5))
    assert adamw.groups[0].spread(steps_to(1.9)) is None  # seed 1 of lr 1e-3 ends at 2.2
    assert steps_to(2.5)(adamw.best.runs[0]) == 2.0  # reached at the first eval

    muon = arms["muon"]
    assert muon.lr_key == "optim.lr_muon" and [g.lr for g in muon.groups] == [0.02, 0.04]
    unfinished, best = muon.groups
    assert not unfinished.counted and unfinished.spread(lambda r: r.final_eval) is None
    assert muon.best is best and muon.best_at_edge
    assert best.spread(lambda r: r.final_eval).mean == pytest.approx(1.1)

    alone = arms["seed=0"]  # one run: its own name, its lr the only one
    assert alone.lr_key == "optim.lr" and len(alone.groups) == 1 and alone.best.lr == 1e-3


def test_compare_prints_both_tables_and_writes_the_plot(sweep, capsys):
    png = sweep / "ab.png"
    assert cli.main(["compare", str(sweep / "adamw"), str(sweep / "muon"), "--plot", str(png),
                     "--target-loss", "1.9"]) == 0
    out = capsys.readouterr().out
    by_lr, best = out.split("Each arm at its best lr:")
    assert "| adamw | optim.lr      | 0.002 * | 0,1   | 1.6500 ± 0.2121 [1.5000, 1.8000] |" in by_lr
    assert "| muon  | optim.lr_muon | 0.02    | 0,1,2 | unfinished or NaN" in by_lr
    assert by_lr.splitlines()[6].endswith("| -            |"), by_lr  # no figures from an unfinished group
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in best.splitlines() if line.startswith("| ") and "optimizer" not in line}
    assert rows["adamw"] == ["adamw", "0.002", "0,1", "1.6500", "0.2121", "1.5000-1.8000", "1.6500", "0.2121",
                             "1.5000-1.8000", "3.00 (2.00-4.00)", "37.5 (25.0-50.0)", "no", "3 (2-4)"]
    assert rows["muon"][:6] == ["muon", "0.04", "0,1,2", "1.1000", "0.1000", "1.0000-1.2000"]
    assert rows["muon"][-2:] == ["yes", "2 (2-2)"]  # 1.1, 1.2, 1.3 at step 2
    assert "| adamw | optim.lr      | 0.001   | 0,1   | 2.1000 ± 0.1414 [2.0000, 2.2000] |" in by_lr
    assert by_lr.splitlines()[3].endswith("| not reached  |"), by_lr
    assert png_size(png.read_bytes()) == (1200, 450)


ADAMW = {"type": "adamw", "lr": 1e-3}
BPE = [{"url": "data/bpe", "weight": 1.0}]
MIXTURE = [{"url": "data/a", "weight": 0.7}, {"url": "data/b", "weight": 0.3}]


def test_runs_on_other_data_with_one_seed_are_two_rows_not_a_mean_over_seeds(tmp_path, capsys):
    """A BPE dataset and a two-source mixture, seed 0 each: two experiments. `data.sources` may
    change across a resume (its identity is checked instead), but not within a seed group."""
    runs = [_run(tmp_path / "runs" / "bpe", ADAMW, 0, [2.5, 2.0], data={"sources": BPE}),
            _run(tmp_path / "runs" / "mix", ADAMW, 0, [2.6, 2.2], data={"sources": MIXTURE})]
    assert cli.main(["compare", *map(str, runs)]) == 0
    out = capsys.readouterr().out
    assert "seeds" not in out and "±" not in out, out  # the per-run table, not the grouped one
    rows = [line.split("|")[1].strip() for line in out.splitlines()[2:]]
    assert rows == ["bpe", "mix"], out


@pytest.mark.parametrize("other", [{"data": {"sources": MIXTURE}}, {"data": {"seq_len": 32}},
                                   {"train": {"eval_batches": 8}}, {"train": {"device": "cuda"}},
                                   {"train": {"eval_every": 1}}, {"train": {"cpu_threads": 2}}])
def test_seeds_that_differ_in_anything_else_are_other_groups(tmp_path, other):
    runs = [summarize(str(_run(tmp_path / "a" / f"seed={s}", ADAMW, s, [2.5, 2.0], data={"sources": BPE})))
            for s in (0, 1)]
    runs.append(summarize(str(_run(tmp_path / "b" / "seed=2", ADAMW, 2, [2.5, 2.0],
                                   data={"sources": BPE, **other.get("data", {})}, train=other.get("train")))))
    assert [[g.seeds for g in a.groups] for a in group_runs(runs)] == [[[0, 1]], [[2]]]


def test_seeds_that_differ_only_in_where_and_how_they_log_and_save_are_one_group(tmp_path):
    runs = [summarize(str(_run(tmp_path / "a" / "seed=0", ADAMW, 0, [2.5, 2.0]))),
            summarize(str(_run(tmp_path / "elsewhere" / "seed=1", ADAMW, 1, [2.5, 2.1],
                               data={"num_workers": 2}, train={"log_every": 1}, checkpoint={"every_steps": 1})))]
    assert [[g.seeds for g in a.groups] for a in group_runs(runs)] == [[[0, 1]]]


def test_a_repeat_of_a_seed_is_never_averaged_with_it(tmp_path):
    """The same setting and seed twice (a rerun elsewhere) are two arms; with seeds 0 and 1 in
    both sweeps, each sweep is one arm over its own two seeds."""
    first = [summarize(str(_run(tmp_path / "first" / f"seed={s}", ADAMW, s, [2.5, 2.0]))) for s in (0, 1)]
    again = [summarize(str(_run(tmp_path / "again" / f"seed={s}", ADAMW, s, [2.5, 2.1]))) for s in (0, 1)]
    arms = group_runs([first[0], again[0], first[1], again[1]])
    assert [(a.name, [[r.run_dir for r in g.runs] for g in a.groups]) for a in arms] == [
        ("first", [[first[0].run_dir, first[1].run_dir]]), ("again", [[again[0].run_dir, again[1].run_dir]])]
    alone = group_runs(first[:1] + again[:1])
    assert [[g.seeds for g in a.groups] for a in alone] == [[[0]], [[0]]]


def test_an_arm_is_named_after_its_folder_only_when_the_folder_is_its_own(tmp_path):
    bpe = [summarize(str(_run(tmp_path / "runs" / f"bpe-s{s}", ADAMW, s, [2.5, 2.0], data={"sources": BPE})))
           for s in (0, 1)]
    mix = summarize(str(_run(tmp_path / "runs" / "mix-s0", ADAMW, 0, [2.6, 2.2], data={"sources": MIXTURE})))
    assert [a.name for a in group_runs([*bpe, mix])] == ["bpe-s0", "mix-s0"]  # not "runs" for both
    assert [a.name for a in group_runs(bpe)] == ["runs"]
