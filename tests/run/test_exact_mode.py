"""`parallel.exact_elastic = "auto"` (the default) decided (harness/run/exact_mode.py): on where its
preconditions hold, off with the first that fails named (buffers a forward updates by name), and a
run keeps the mode it started in."""

import pytest

from harness.config import RunConfig
from harness.errors import UserError
from harness.run.exact_mode import decide, with_buffers, with_mode


def config(**train):
    return RunConfig.model_validate({"data": {"batch_size": 2},
                                     "train": {"global_batch": 8, "cpu_threads": 1, **train}})


def test_on_where_every_precondition_holds():
    assert decide(config(), 2, "cpu", iterator_data=False) == (True, "auto: every precondition holds")
    assert decide(config(cpu_threads=None), 2, "cuda", iterator_data=False)[0]


@pytest.mark.parametrize("cfg, world, device, iterator, named", [
    (RunConfig.model_validate({"train": {"global_batch": 8, "cpu_threads": 1}}), 2, "cpu", False, "data.batch_size"),
    (config(global_batch=None), 2, "cpu", False, "train.global_batch is not set"),
    (config(grad_accum=2), 2, "cpu", False, "train.grad_accum is set"),
    (config(global_batch=9), 1, "cpu", False, "not a whole number"),
    (config(global_batch=12), 2, "cpu", False, "world size 2 is not exact for 6 micro-batches"),
    (config(cpu_threads=None), 2, "cpu", False, "train.cpu_threads"),
    (config(), 2, "cpu", True, "data.factory iterator"),
])
def test_off_naming_the_precondition_that_fails(cfg, world, device, iterator, named):
    exact, why = decide(cfg, world, device, iterator)
    assert not exact and why.startswith("auto: off") and named in why, why


def test_a_run_keeps_the_mode_it_started_in():
    """Started without it: stays without it. Started in it: stays in it where it can, and goes
    on without it at a world size that is not exact."""
    assert decide(config(), 2, "cpu", False, saved=False) == (
        False, "auto: off, the checkpoint resumed from was trained without it (a run keeps its mode)")
    assert decide(config(), 1, "cpu", False, saved=True)[0]
    assert not decide(config(global_batch=12), 2, "cpu", False, saved=True)[0]


def test_an_explicit_setting_is_taken_as_it_is():
    cfg = config(grad_accum=2)
    for setting in (True, False):
        chosen = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"exact_elastic": setting})})
        assert decide(chosen, 3, "cpu", True) == (setting, f"parallel.exact_elastic = {str(setting).lower()}")


def test_the_decided_config_holds_a_bool():
    cfg = config()
    assert cfg.parallel.exact_elastic == "auto"
    assert with_mode(cfg, True).parallel.exact_elastic is True and cfg.parallel.exact_elastic == "auto"


BN = ["model.norm.num_batches_tracked", "model.norm.running_mean", "model.norm.running_var"]


def test_buffers_a_forward_updates_turn_auto_off_naming_them_and_refuse_true():
    on = (True, "auto: every precondition holds")
    exact, why = with_buffers("auto", on, BN)
    assert not exact and why.startswith("auto: off, the model's forward updates buffers ") and all(b in why for b in BN)
    with pytest.raises(UserError, match=r"^parallel.exact_elastic = true, but the model's forward updates buffers "
                                        r"model.norm.num_batches_tracked, model.norm.running_mean"):
        with_buffers(True, (True, "parallel.exact_elastic = true"), BN)
    assert with_buffers("auto", on, []) == on
    off = (False, "auto: off, train.global_batch is not set")
    assert with_buffers("auto", off, BN) == off


def test_many_buffers_are_named_up_to_a_few_and_counted():
    many = [f"model.bn{i}.running_mean" for i in range(10)]
    _, why = with_buffers("auto", (True, "auto: every precondition holds"), many)
    assert "model.bn5.running_mean and 4 more" in why and "bn6" not in why
