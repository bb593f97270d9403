"""Experiment arms: every config validates, arms differ from their base only in the optimizer,
`harness sweep` trains (and skips finished) arms in real processes, and `harness compare`'s
table matches numbers recomputed here from the runs' files, and its PNG has the promised size."""

from __future__ import annotations

import json
import statistics
import tomllib
from pathlib import Path

import pytest

from harness import cli
from harness.config import load_config
from harness.errors import UserError
from harness.experiments.comparison import summarize
from png import png_size
from procs import events

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
BASE = CONFIGS / "arms" / "base.toml"
ARMS = sorted((CONFIGS / "muon").glob("*.toml")) + sorted((CONFIGS / "price-list").glob("*.toml"))
# The A/B with lr sweeps (docs/arms.md): its own shrunk base, the same rule for its arms.
AB_BASE = CONFIGS / "ab" / "base.toml"
AB_ARMS = sorted(p for p in (CONFIGS / "ab").glob("*.toml") if p != AB_BASE)
ALL_CONFIGS = sorted(CONFIGS.rglob("*.toml"))

# Two arms shrunk to seconds: one-layer GPT on 16-token windows, 6 steps, a checkpoint and an
# evaluation every 3 steps.
TINY = ["train.steps=6", "model.args={n_layer=1,n_head=2,d_model=32,seq_len=16}", "data.seq_len=16",
        "data.batch_size=4", "train.eval_every=3", "train.eval_batches=2", "checkpoint.every_steps=3"]


def test_every_config_loads():
    names = {p.relative_to(CONFIGS).as_posix() for p in ALL_CONFIGS}
    assert {"quickstart.toml", "arms/base.toml", "muon/control.toml", "muon/muon-1x.toml",
            "muon/muon-4x.toml", "muon/muon-rms0.2.toml", "price-list/lion.toml", "price-list/olion.toml",
            "price-list/adafactor.toml", "price-list/sgdm.toml"} <= names
    for path in ALL_CONFIGS:
        load_config(path)


@pytest.mark.parametrize("arm", ARMS + AB_ARMS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_arm_differs_from_base_only_in_optimizer(arm):
    raw = tomllib.loads(arm.read_text())
    assert set(raw) <= {"extends", "run_dir", "optim"}, f"{arm} sets more than run_dir and [optim]"
    base_path, runs = (AB_BASE, "runs/ab") if arm in AB_ARMS else (BASE, "runs/arms")
    assert (arm.parent / raw["extends"]).resolve() == base_path
    cfg, base = load_config(arm), load_config(base_path)
    assert cfg.run_dir == f"{runs}/{arm.stem}"

    def shared(c):
        return {k: v for k, v in c.model_dump(mode="json").items() if k not in ("run_dir", "optim")}

    assert shared(cfg) == shared(base)
    assert cfg.optim.type == raw["optim"]["type"]


def test_muon_arms_follow_the_pr_note():
    one, four = load_config(CONFIGS / "muon" / "muon-1x.toml"), load_config(CONFIGS / "muon" / "muon-4x.toml")
    rms = load_config(CONFIGS / "muon" / "muon-rms0.2.toml")
    control = load_config(CONFIGS / "muon" / "control.toml")
    assert control.optim.type == "adamw"
    assert four.optim.lr_muon == pytest.approx(4 * one.optim.lr_muon)
    assert one.optim.consistent_rms is None and four.optim.consistent_rms is None
    assert rms.optim.consistent_rms == 0.2 and rms.optim.lr_muon == control.optim.lr


@pytest.mark.parametrize("body, key", [
    ('[optim]\ntype = "muon"\nlr_muonn = 0.1\n', "optim.lr_muonn"),
    ('[optim]\ntype = "muon"\ngamma = 0.2\n', "optim.gamma"),  # an olion key in a muon arm
    ('run_dri = "runs/x"\n', "run_dri"),
    ('[train]\nstep = 10\n', "train.step"),
])
def test_unknown_key_in_an_arm_is_rejected(tmp_path, body, key):
    arm = tmp_path / "typo.toml"
    arm.write_text(f'extends = "{BASE}"\n{body}')
    with pytest.raises(UserError) as e:
        load_config(arm)
    assert f"{key}: unknown key" in str(e.value) and str(arm) in str(e.value)


def test_sweep_refuses_two_arms_in_one_run_dir(tmp_path, capsys):
    arms = [_write_arm(tmp_path, name, tmp_path / "same", 'type = "adamw"') for name in ("a", "b")]
    assert cli.main(["sweep", *map(str, arms)]) == 2
    assert "both train in run_dir" in capsys.readouterr().err


def test_sweep_then_compare(tmp_path, capsys):
    arms = [_write_arm(tmp_path, "control", tmp_path / "runs" / "control", 'type = "adamw"\nlr = 3e-3'),
            _write_arm(tmp_path, "muon", tmp_path / "runs" / "muon", 'type = "muon"\nlr = 3e-3\nlr_muon = 0.02')]
    overrides = [arg for item in TINY for arg in ("--set", item)]
    assert cli.main(["sweep", *map(str, arms), *overrides]) == 0
    out = capsys.readouterr().out
    assert out.count(" finished ") == 2, out
    run_dirs = [str(tmp_path / "runs" / name) for name in ("control", "muon")]
    metrics_before = [(Path(d) / "metrics.jsonl").read_text() for d in run_dirs]

    # Again: a finished arm is skipped and its files stay as they were.
    assert cli.main(["sweep", str(arms[0]), *overrides]) == 0
    assert "skipped (already finished)" in capsys.readouterr().out
    assert (Path(run_dirs[0]) / "metrics.jsonl").read_text() == metrics_before[0]

    png = tmp_path / "arms.png"
    assert cli.main(["compare", *run_dirs, "--plot", str(png)]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {cells[0]: cells for cells in (_cells(line) for line in table[2:])}
    assert _cells(table[0])[:3] == ["arm", "optimizer", "steps"] and set(rows) == {"control", "muon"}
    for run_dir in run_dirs:
        expected = _recompute(Path(run_dir))
        name = Path(run_dir).name
        assert rows[name] == [name, expected["optimizer"], str(expected["steps"]),
                              f"{expected['final_eval']:.4f}", f"{expected['best_eval']:.4f}",
                              f"{expected['tokens_per_s']:.0f}", f"{100 * expected['optim_share']:.1f}",
                              f"{expected['checkpoint_s']:.2f}", "0.00", f"{expected['wall_s']:.1f}"]
        arm = summarize(run_dir)
        for key, value in expected.items():
            assert getattr(arm, key) == (value if isinstance(value, str) else pytest.approx(value, rel=1e-12)), key
    assert png_size(png.read_bytes()) == (1200, 450)


def _write_arm(folder: Path, name: str, run_dir: Path, optim: str) -> Path:
    arm = folder / f"{name}.toml"
    arm.write_text(f'extends = "{BASE}"\nrun_dir = "{run_dir}"\n\n[optim]\n{optim}\nwarmup = 2\n')
    return arm


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _recompute(run_dir: Path) -> dict:
    """The table's numbers, straight from run.json, metrics.jsonl and events.jsonl."""
    config = json.loads((run_dir / "run.json").read_text())["config"]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    run_events = events(run_dir)
    train = [r for r in lines if "loss" in r]
    evals = [r["eval_loss"] for r in lines if "eval_loss" in r]
    tokens = config["data"]["batch_size"] * config["data"]["seq_len"] * config["train"]["grad_accum"]
    blocking = [e["blocking_s"] for e in run_events if e["event"] == "checkpoint"]
    assert len(train) == 6 and len(evals) >= 2 and len(blocking) >= 2 and all(b > 0 for b in blocking)
    assert not any(e["event"] == "restart" for e in run_events)
    start = run_events[0]["time"] - run_events[0].get("startup_s", 0.0)
    return {
        "optimizer": config["optim"]["type"],
        "steps": max(r["step"] for r in train),
        "final_eval": evals[-1],
        "best_eval": min(evals),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train),
        "optim_share": sum(r["optim_s"] for r in train) / sum(tokens / r["tokens_per_s"] for r in train),
        "checkpoint_s": sum(blocking),
        "wall_s": run_events[-1]["time"] - start,
    }


def test_compare_counts_the_global_batch_when_it_is_set(tmp_path):
    """With train.global_batch the config's batch_size x grad_accum is not what ran (one of them
    is derived per world size); the optimizer share must use the global batch."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"config": {"data": {"batch_size": 4, "seq_len": 8},
                                                         "train": {"grad_accum": 1, "global_batch": 16}}}))
    # 16 samples x 8 tokens = 128 tokens per step at 64 tokens/s: 2 s per step, 0.5 s in the optimizer.
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "tokens_per_s": 64.0,
                                                           "optim_s": 0.5, "time": float(s)}) + "\n"
                                               for s in (1, 2)))
    assert summarize(str(run)).optim_share == pytest.approx(0.25)
