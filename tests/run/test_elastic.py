"""The world-size change of a resume, in-process: the valid world sizes, what the event records, the
restarted random streams, and the verdict of `verify-resume --world-sizes` (the runs themselves:
tests/distributed/test_elastic.py)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from harness.config import RunConfig, batch_shape, load_config, valid_world_sizes
from harness.errors import UserError
from harness.run.elastic import after_load, fingerprint_checks, reseed, world_change
from harness.verify.world_equivalence import WorldVerdict, compare_worlds, even_points, refuse_what_cannot_pass
from procs import ROOT, TINY, assert_one_line_error, harness

ELASTIC = ROOT / "tests" / "data" / "elastic.toml"


def _cfg(data: dict, train: dict) -> RunConfig:
    return RunConfig.model_validate({"data": data, "train": train})


def test_valid_world_sizes_hold_the_set_factor_and_derive_the_other():
    assert valid_world_sizes(_cfg({"batch_size": 2}, {"global_batch": 8})) == [1, 2, 4]
    assert valid_world_sizes(_cfg({}, {"global_batch": 24, "grad_accum": 3})) == [1, 2, 4, 8]
    assert valid_world_sizes(_cfg({"batch_size": 4}, {"global_batch": 16, "grad_accum": 2})) == [2]
    assert valid_world_sizes(_cfg({"batch_size": 5}, {"global_batch": 16, "grad_accum": 2})) == []
    assert valid_world_sizes(RunConfig()) == []  # no global_batch: every world size, the batch grows with it


def test_a_world_size_without_a_split_names_the_valid_ones():
    with pytest.raises(UserError, match="the valid world sizes for this config are 1, 2, 4: run at one of those"):
        batch_shape(_cfg({"batch_size": 2}, {"global_batch": 8}), 3)


def test_a_batch_split_error_says_what_was_given_and_what_is_derived():
    with pytest.raises(UserError) as e:
        batch_shape(_cfg({}, {"global_batch": 16}), 2)  # batch_size at its default, grad_accum derived
    assert str(e.value) == (
        "train.global_batch = 16 does not split over 2 rank(s) with data.batch_size = 16 (its default): "
        "train.grad_accum (not set, so derived) would be 16 / (16 x 2), not a whole number; the valid world sizes "
        "for this config are 1: run at one of those, or make global_batch a multiple of data.batch_size x world "
        "size (32), or change data.batch_size")
    with pytest.raises(UserError, match=r"with train.grad_accum = 3: data.batch_size \(not set, so derived\) would be "
                                        r"16 / \(3 x 1\), not a whole number; no world size splits it"):
        batch_shape(_cfg({}, {"global_batch": 16, "grad_accum": 3}), 1)
    with pytest.raises(UserError, match=r"with data.batch_size = 4 and train.grad_accum = 2: "
                                        r"4 x 2 x world size 1 is 8; .* or --set train.grad_accum=null"):
        batch_shape(_cfg({"batch_size": 4}, {"global_batch": 16, "grad_accum": 2}), 1)


def test_world_change_records_the_derived_accumulation():
    cfg = _cfg({"batch_size": 2}, {"global_batch": 8})
    assert world_change({"world_size": 2}, cfg, 2, step=4, shape=batch_shape(cfg, 2)) is None
    assert world_change({}, cfg, 1, step=4, shape=batch_shape(cfg, 1)) is None  # no key: written by one process
    change = world_change({"world_size": 2}, cfg, 1, step=4, shape=batch_shape(cfg, 1))
    assert change.event() == {"step": 4, "old_world_size": 2, "new_world_size": 1,
                              "old": {"batch_size": 2, "grad_accum": 2, "global_batch": 8},
                              "new": {"batch_size": 2, "grad_accum": 4, "global_batch": 8}}
    # Without global_batch the global batch follows the world size (warned, recorded).
    grown = world_change({}, _cfg({"batch_size": 2}, {}), 2, step=4, shape=batch_shape(_cfg({"batch_size": 2}, {}), 2))
    assert grown.global_batch == (2, 4)


def test_restarted_streams_depend_on_step_rank_and_world_only():
    cfg = _cfg({"batch_size": 2}, {"global_batch": 8})

    def draws(meta: dict, world: int, rank: int) -> list:
        torch.manual_seed(123)  # whatever the streams were before
        random.seed(5)
        reseed(world_change(meta, cfg, world, step=8, shape=batch_shape(cfg, world)), seed=1, rank=rank)
        return [torch.rand(3).tolist(), random.random()]

    assert draws({"world_size": 1}, 2, 1) == draws({"world_size": 4}, 2, 1)  # not the saving layout's
    assert draws({"world_size": 1}, 2, 0) != draws({"world_size": 1}, 2, 1)
    assert draws({"world_size": 1}, 2, 0) != draws({"world_size": 1}, 4, 0)


def test_a_sharded_part_is_not_checked_against_its_hash_at_save_time_across_world_sizes():
    """That hash covered rank 0's shard (FSDP), which no rank holds after resharding: the restored
    check leaves the part out (the e2e run: tests/distributed/test_elastic.py, fsdp)."""
    cfg = _cfg({"batch_size": 2}, {"global_batch": 8})
    sharded = {"model": {"w": {"$tensor": ["$dcp", "model/w"]}}, "sched": {"step": 4}}
    plain = {"model": {"w": {"$tensor": ["model.safetensors", "w"]}}, "sched": {"step": 4}}
    from_fsdp = after_load({"meta": {"world_size": 2}, "parts": sharded}, cfg, 4, sharded=(), shape=(2, 4))
    assert from_fsdp.resharded == {"model"}
    assert fingerprint_checks(from_fsdp) == {"inputs_only": True, "unchecked": ("rng", "model")}
    # One process's checkpoint into FSDP would be resharded too (this process shards "optim" for the test).
    into_fsdp = after_load({"meta": {"world_size": 4}, "parts": plain}, cfg, 4, sharded=("optim",), shape=(2, 4))
    assert fingerprint_checks(into_fsdp)["unchecked"] == ("rng", "optim")
    # DDP at both ends: the replicated parts are still checked; the same world size changes nothing.
    ddp = after_load({"meta": {"world_size": 2}, "parts": plain}, cfg, 4, sharded=(), shape=(2, 4))
    assert fingerprint_checks(ddp)["unchecked"] == ("rng",)
    assert after_load({"meta": {}, "parts": sharded}, cfg, 4, sharded=(), shape=(2, 4)) is None
    assert fingerprint_checks(None) == {}


def test_world_verdict_fails_on_any_check():
    ok = dict(sizes=[2, 1], steps=12, tolerance=1e-4, interrupt_at=[6], state_dev={"model": 1e-8})
    assert WorldVerdict(**ok)
    assert not WorldVerdict(**ok, batch_step=7)
    assert not WorldVerdict(**{**ok, "state_dev": {"model": 1e-3}})
    assert not WorldVerdict(**ok, loss_dev=2e-4, loss_step=9)
    assert not WorldVerdict(**ok, unequal=["parts/data/position: A=8 B=16"])
    verdict = WorldVerdict(**ok, missing_changes=["world size 2 -> 1: no resume made that change"])
    assert not verdict and "not exercised: world size 2 -> 1" in str(verdict)
    assert even_points(12, [2, 1, 2]) == [4, 8]


def test_verify_resume_refuses_a_world_size_and_a_tolerance_it_cannot_use_before_running(tmp_path):
    work = tmp_path / "work"
    proc = harness("verify-resume", str(ELASTIC), "--world-sizes", "2,3", "--work-dir", str(work))
    assert_one_line_error(proc, "the valid world sizes for this config are 1, 2, 4")
    proc = harness("verify-resume", str(ELASTIC), "--world-sizes", "2,1,2", "--interrupt-at", "6",
                   "--work-dir", str(work))
    assert_one_line_error(proc, "give 2 step(s), one per world size after the first")
    proc = harness("verify-resume", str(ELASTIC), "--tolerance", "1e-3", "--work-dir", str(work))
    assert_one_line_error(proc, "--tolerance applies to --world-sizes only")
    # Configs whose check cannot pass: found out before the runs, not after them.
    proc = harness("verify-resume", str(TINY), "--world-sizes", "2,1", "--set", "model.args.dropout=0",
                   "--work-dir", str(work))
    assert_one_line_error(proc, "--world-sizes 2,1: the config sets no train.global_batch, so a step's batch")
    assert "--set train.global_batch=16, the batch at world size 2" in proc.stderr
    proc = harness("verify-resume", str(ELASTIC), "--world-sizes", "2,1", "--work-dir", str(work))
    assert_one_line_error(proc, "--world-sizes 2,1: model.args.dropout = 0.1: dropout masks are drawn per rank")
    assert not work.exists()


def test_what_cannot_pass_is_only_refused_across_a_change_and_dropout_only_under_the_default_tolerance():
    no_global_batch = load_config(TINY, ["model.args.dropout=0"])
    refuse_what_cannot_pass(no_global_batch, [2, 2], None)  # no change of world size: nothing to refuse
    with_dropout = load_config(ELASTIC)
    refuse_what_cannot_pass(with_dropout, [2, 1], 0.05)  # a tolerance given for the noise: a warning
    with pytest.raises(UserError, match="model.args.dropout = 0.1"):
        refuse_what_cannot_pass(with_dropout, [2, 1], None)


def test_the_loss_deviation_is_over_every_step_both_runs_logged(tmp_path):
    """Runs on other batches (another seed) and a step B's log lost: the verdict reports the
    deviation of every step both logged, how many were on different batches, and the step that
    was not comparable; not "max deviation 0" from comparing only the steps of equal batches."""
    a, b = tmp_path / "a", tmp_path / "b"
    fast = ["--set", "train.steps=4", "--set", "checkpoint.every_steps=2", "--set", "model.args.dropout=0"]
    harness("train", str(ELASTIC), "--run-dir", str(a), *fast, check=True)
    harness("train", str(ELASTIC), "--run-dir", str(b), *fast, "--set", "train.seed=2", check=True)
    metrics = b / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line).get("step") != 3))
    losses = [{r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "batch_hash" in r} for run in (a, b)]
    expected = max(abs(losses[0][s] - losses[1][s]) / max(1.0, abs(losses[0][s])) for s in (1, 2, 4))
    assert expected > 0

    verdict = compare_worlds(a, b, 4, [1, 1], [2], 1e-4)
    assert verdict.loss_dev == pytest.approx(expected, rel=1e-12) and verdict.batch_step == 1
    assert (verdict.loss_steps, verdict.loss_other_batches, verdict.not_logged) == (3, 3, {"A": [], "B": [3]})
    assert (f"  loss: max deviation {expected:.3g} (step {verdict.loss_step}) over 3 of 4 steps, 3 of them on "
            "different batches (which alone changes their loss); not comparable: 1 not logged by B (step 3)"
            ) in str(verdict).splitlines()
