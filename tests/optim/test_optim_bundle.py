"""MultiOpt / MultiSched: name-keyed state, refusals that name the culprit, torch-like surface."""

import pytest
import torch

from harness.errors import UserError
from optim.build import build_bundle, parse_optim_config
from optim.bundle import MultiOpt, MultiSched


@pytest.fixture
def trained(tiny_gpt, train):
    """An adafactor + adamw bundle after two steps, and a way to build a fresh one for the same config."""
    cfg = parse_optim_config({"type": "adafactor", "lr": 1e-3})
    model = tiny_gpt()
    opt, sched = build_bundle(cfg, model, 10)
    train(model, opt, sched, 0, 2)
    return opt, sched, lambda: build_bundle(cfg, tiny_gpt(), 10)


def test_state_is_keyed_by_optimizer_and_parameter_name(trained):
    opt, sched, _ = trained
    sd = opt.state_dict()
    assert list(sd) == ["adafactor", "adamw"] and list(sched.state_dict()) == ["adafactor", "adamw"]
    assert set(sd["adafactor"]["state"]["blocks.0.fc.weight"]) == {"r", "c"}
    assert sd["adamw"]["param_groups"][0]["betas"] == [0.9, 0.999]
    assert "emb.weight" in sd["adamw"]["param_groups"][0]["params"]
    assert "lr_lambdas" not in sched.state_dict()["adamw"]


def test_loading_adopts_tensors_without_copying_and_restores_tuples(trained, roundtrip):
    opt, _, fresh = trained
    sd = roundtrip(opt.state_dict())
    new_opt, _ = fresh()
    new_opt.load_state_dict(sd)
    adamw = new_opt.optimizers["adamw"]
    p = adamw.param_groups[0]["params"][0]
    name = adamw.param_groups[0]["param_names"][0]
    assert new_opt.optimizers["adamw"].state[p]["exp_avg"] is sd["adamw"]["state"][name]["exp_avg"]
    assert adamw.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda sd: sd.pop("adamw"), "lacks optimizer 'adamw'"),
    (lambda sd: sd.update(lion=sd["adamw"]), "has optimizer 'lion'"),
    (lambda sd: sd["adamw"]["param_groups"][0]["params"].remove("head.weight"), "lacks parameter 'head.weight'"),
    (lambda sd: sd["adamw"]["param_groups"][0]["params"].append("head.bias"), "has parameter 'head.bias'"),
    (lambda sd: sd["adamw"]["param_groups"].append({"params": []}), "2 parameter groups"),
    (lambda sd: sd["adafactor"]["state"]["blocks.1.fc.weight"].update(r=torch.zeros(3)),
     r"tensor optim/adafactor/blocks.1.fc.weight/r has shape \(3,\), this run expects \(64,\)"),
    (lambda sd: sd["adamw"]["state"]["emb.weight"].update(exp_avg=torch.zeros(2, 2)),
     r"tensor optim/adamw/emb.weight/exp_avg has shape \(2, 2\)"),
    (lambda sd: sd["adamw"]["state"].update(ghost={}), "state for 'ghost'"),
])
def test_loading_refuses_a_mismatch_and_names_it(trained, edit, message):
    opt, _, fresh = trained
    sd = opt.state_dict()
    edit(sd)
    new_opt, _ = fresh()
    with pytest.raises(UserError, match=message):
        new_opt.load_state_dict(sd)
    # Refused before anything was loaded: no optimizer of the bundle took the partial state.
    assert all(not o.state for o in new_opt.optimizers.values())


def test_loading_refuses_a_parameter_in_another_group(tiny_gpt):
    plain = build_bundle(parse_optim_config({}), tiny_gpt(), 10)[0].state_dict()
    head = parse_optim_config({"head_lr_mult": 2.0, "head_pattern": "head.*"})
    split, _ = build_bundle(head, tiny_gpt(), 10)
    plain["adamw"]["param_groups"].append({**plain["adamw"]["param_groups"][0], "params": []})
    with pytest.raises(UserError, match="in group 1 of optim/adamw"):
        split.load_state_dict(plain)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda sd: sd.pop("adamw"), "lacks scheduler 'adamw'"),
    (lambda sd: sd.update(extra={}), "has scheduler 'extra'"),
])
def test_scheduler_loading_refuses_a_missing_or_extra_scheduler(trained, edit, message):
    _, sched, fresh = trained
    sd = sched.state_dict()
    edit(sd)
    _, new_sched = fresh()
    with pytest.raises(UserError, match=message):
        new_sched.load_state_dict(sd)


def test_behaves_like_a_torch_optimizer(trained):
    opt, sched, _ = trained
    groups = opt.param_groups
    assert groups == [g for o in opt.optimizers.values() for g in o.param_groups]
    groups[0]["lr"] = 0.5
    assert opt.optimizers["adafactor"].param_groups[0]["lr"] == 0.5
    assert all(p.grad is not None for g in groups for p in g["params"])
    opt.zero_grad()
    assert all(p.grad is None for g in groups for p in g["params"])
    assert set(sched.get_last_lr()) == {"adafactor", "adamw"}


def test_optimizers_must_carry_unique_parameter_names():
    w = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="without parameter names"):
        MultiOpt({"sgd": torch.optim.SGD([w], lr=0.1)})
    with pytest.raises(ValueError, match="'w' is in both 'a' and 'b'"):
        MultiOpt({"a": torch.optim.SGD([("w", w)], lr=0.1), "b": torch.optim.SGD([("w", w)], lr=0.1)})
    assert MultiSched({}).get_last_lr() == {}
