"""MultiOpt / MultiSched: name-keyed state, refusals that name the culprit, torch-like surface."""

import pytest
import torch

from optim.adafactor import Adafactor2D
from optim.build import build_bundle
from optim.bundle import MultiOpt
from optim.config import parse_optim_config
from optim.errors import OptimError
from optim.lion import Lion
from optim.muon import Muon
from optim.olion import OLion
from optim.schedulers import MultiSched


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
    assert "emb.weight" in sd["adamw"]["param_groups"][1]["params"]  # the group without decay
    assert sched.state_dict()["adamw"]["schedule"]["kind"] == "cosine"


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
    (lambda sd: sd["adamw"]["param_groups"][0].pop("amsgrad"),
     r"optim/adamw group 0 lacks hyperparameter 'amsgrad' that AdamW here does have"),
    (lambda sd: sd["adafactor"]["param_groups"][0].update(beta1=0.9),
     r"optim/adafactor group 0 has hyperparameter 'beta1' that Adafactor2D here does not have"),
    (lambda sd: sd["adafactor"]["state"]["blocks.1.fc.weight"].pop("c"),
     r"optim/adafactor/blocks.1.fc.weight lacks state 'c' \(has \['r'\]\); Adafactor2D would silently"),
    (lambda sd: sd["adamw"]["state"]["emb.weight"].update(momentum_buffer=torch.zeros(2)),
     r"optim/adamw/emb.weight has state 'momentum_buffer', which AdamW does not keep"),
    (lambda sd: sd["adamw"]["state"]["emb.weight"].update(exp_avg=0.5),
     r"tensor optim/adamw/emb.weight/exp_avg has shape float"),
    (lambda sd: sd["adamw"].pop("state"), r"checkpoint optim/adamw is malformed: expected \{"),
    (lambda sd: sd["adamw"]["param_groups"].append(["head.bias"]), r"optim/adamw group 2 is malformed"),
    (lambda sd: sd["adafactor"]["state"]["blocks.1.fc.weight"].update(r=torch.zeros(3)),
     r"tensor optim/adafactor/blocks.1.fc.weight/r has shape \(3,\), this run expects \(64,\)"),
    (lambda sd: sd["adamw"]["state"]["emb.weight"].update(exp_avg=torch.zeros(2, 2)),
     r"tensor optim/adamw/emb.weight/exp_avg has shape \(2, 2\)"),
    (lambda sd: sd["adamw"]["state"].update(ghost={}), "state for 'ghost'"),
])
def test_loading_refuses_a_mismatch_and_names_it(trained, edit, message, tree_equal):
    opt, _, fresh = trained
    sd = opt.state_dict()
    edit(sd)
    new_opt, _ = fresh()
    before = new_opt.state_dict()
    with pytest.raises(OptimError, match=message):
        new_opt.load_state_dict(sd)
    # Refused before anything was loaded: no optimizer of the bundle took the partial state (its
    # own optimizers hold their fresh, eagerly created zeros; AdamW none yet).
    tree_equal(new_opt.state_dict(), before)
    assert not new_opt.optimizers["adamw"].state


def test_the_reference_list_format_is_refused_with_a_clear_error(trained):
    """The team reference's MultiOpt.state_dict() is a list of torch state dicts (positional)."""
    opt, sched, fresh = trained
    new_opt, new_sched = fresh()
    with pytest.raises(OptimError, match=r"checkpoint optim is a list, not a dict keyed by optimizer name: "
                                        r"it looks like the team reference's positional MultiOpt state"):
        new_opt.load_state_dict([o.state_dict() for o in opt.optimizers.values()])
    with pytest.raises(OptimError, match="checkpoint sched is a list"):
        new_sched.load_state_dict([s.state_dict() for s in sched.schedulers.values()])


def test_a_muon_checkpoint_without_momentum_or_a_group_key_is_refused(tiny_gpt, train):
    """Before: a missing `mom` restarted momentum at zero; a missing `ns_batched` loaded and
    then step() raised KeyError."""
    cfg = parse_optim_config({"type": "muon"})
    model = tiny_gpt()
    opt, sched = build_bundle(cfg, model, 10)
    train(model, opt, sched, 0, 1)
    for edit, message in [
        (lambda sd: sd["muon"]["state"]["blocks.0.fc.weight"].pop("mom"),
         r"optim/muon/blocks.0.fc.weight lacks state 'mom' \(has \[\]\); Muon would silently restart it at zero"),
        (lambda sd: sd["muon"]["state"]["blocks.0.fc.weight"].update(momentum_buffer=torch.zeros(64, 16)),
         r"has state 'momentum_buffer', which Muon does not keep \(it keeps \['mom'\]\)"),
        (lambda sd: sd["muon"]["param_groups"][0].pop("ns_batched"),
         r"optim/muon group 0 lacks hyperparameter 'ns_batched' that Muon here does have"),
    ]:
        sd = opt.state_dict()
        edit(sd)
        new_opt, _ = build_bundle(cfg, tiny_gpt(), 10)
        with pytest.raises(OptimError, match=message):
            new_opt.load_state_dict(sd)
        # Nothing loaded: Muon's momentum is still its fresh zeros, AdamW has no state yet.
        assert not new_opt.optimizers["adamw"].state
        assert all(not v.any() for st in new_opt.optimizers["muon"].state.values() for v in st.values())


def test_hyperparameters_and_grouping_come_from_the_bundle_not_the_checkpoint(trained, roundtrip, tiny_gpt):
    """A changed config (`--allow-config-change`) takes effect: lr, weight decay, betas and the
    head split are the new bundle's; the per-parameter state is the checkpoint's."""
    opt, sched, _ = trained
    ckpt = roundtrip({"optim": opt.state_dict(), "sched": sched.state_dict()})
    cfg = parse_optim_config({"type": "adafactor", "lr": 1e-4, "weight_decay": 0.3, "adam_betas": [0.8, 0.9],
                              "head_lr_mult": 2.0, "head_pattern": "head.*"})
    new_opt, new_sched = build_bundle(cfg, tiny_gpt(), 10)
    new_opt.load_state_dict(ckpt["optim"])
    new_sched.load_state_dict(ckpt["sched"])
    adamw = new_opt.optimizers["adamw"]
    multiplier = new_sched.schedulers["adamw"].schedule.multiplier(2)
    # The rest (1-D and the embedding: no decay) and the head at twice the lr, where the
    # checkpoint had [head (decayed), the rest], all at one lr, and another decay and betas.
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in adamw.param_groups] == [
        (1e-4 * multiplier, 0.0, (0.8, 0.9)), (2e-4 * multiplier, 0.3, (0.8, 0.9))]
    assert new_opt.restored_with_changes == ["adafactor/initial_lr", "adamw/betas", "adamw/initial_lr",
                                             "adamw/weight_decay"]
    assert new_sched.restored_with_changes == ["adafactor/base_lrs", "adamw/base_lrs"]
    names = {n: p for g in adamw.param_groups for n, p in zip(g["param_names"], g["params"], strict=True)}
    saved = ckpt["optim"]["adamw"]["state"]["head.weight"]["exp_avg"]
    assert torch.equal(adamw.state[names["head.weight"]]["exp_avg"], saved)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda sd: sd.pop("adamw"), "lacks scheduler 'adamw'"),
    (lambda sd: sd.update(extra={}), "has scheduler 'extra'"),
    (lambda sd: sd["adamw"].pop("last_epoch"), r"checkpoint sched/adamw is malformed: KeyError"),
    (lambda sd: sd["adamw"].update(schedule={"kind": "step"}),
     r"sched/adamw is malformed: ValueError: unknown schedule"),
])
def test_scheduler_loading_refuses_a_missing_or_extra_scheduler(trained, edit, message):
    _, sched, fresh = trained
    sd = sched.state_dict()
    edit(sd)
    _, new_sched = fresh()
    with pytest.raises(OptimError, match=message):
        new_sched.load_state_dict(sd)
    assert new_sched.state_dict() == fresh()[1].state_dict()  # refused before loading any


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
    with pytest.raises(ValueError, match="'lbfgs': LBFGS does not declare its state keys"):
        MultiOpt({"lbfgs": torch.optim.LBFGS([("w", w)], lr=0.1)})
    assert MultiSched({}).get_last_lr() == {}


def test_changed_muon_hyperparameters_apply_after_a_load(tiny_gpt, train, roundtrip):
    """lr_muon, momentum, ns_steps and Muon's weight decay of the new config, Muon's `mom` of the
    checkpoint; the schedule continues from the restored step (before: all from the checkpoint)."""
    model = tiny_gpt()
    opt, sched = build_bundle(parse_optim_config({"type": "muon", "warmup": 2}), model, 10)
    train(model, opt, sched, 0, 3)
    ckpt = roundtrip({"optim": opt.state_dict(), "sched": sched.state_dict()})
    cfg = parse_optim_config({"type": "muon", "warmup": 2, "lr_muon": 0.05, "momentum": 0.9, "ns_steps": 3,
                              "muon_weight_decay": 0.1})
    new_opt, new_sched = build_bundle(cfg, tiny_gpt(), 10)
    new_opt.load_state_dict(ckpt["optim"])
    new_sched.load_state_dict(ckpt["sched"])
    (group,) = new_opt.optimizers["muon"].param_groups
    multiplier = new_sched.schedulers["muon"].schedule.multiplier(3)
    expected = (0.05 * multiplier, 0.9, 3, 0.1)
    assert (group["lr"], group["momentum"], group["ns_steps"], group["weight_decay"]) == expected
    p = group["params"][0]
    assert new_opt.optimizers["muon"].state[p]["mom"] is ckpt["optim"]["muon"]["state"][group["param_names"][0]]["mom"]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True), lambda ps: torch.optim.Adagrad(ps),
    lambda ps: torch.optim.Adamax(ps), lambda ps: torch.optim.NAdam(ps), lambda ps: torch.optim.RAdam(ps),
    lambda ps: torch.optim.Adadelta(ps), lambda ps: torch.optim.ASGD(ps), lambda ps: torch.optim.Rprop(ps),
    lambda ps: torch.optim.Adam(ps, amsgrad=True), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
])
def test_torchs_own_optimizers_round_trip_by_name_and_step_on_bitwise(make, roundtrip):
    """Every torch optimizer the bundle knows: its state after a step saved name-keyed and loaded
    into a fresh one (the parameters restored too), the next step is bitwise the uninterrupted
    one's; a state without one of its keys is refused, naming it."""
    def build():
        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 2)
        return layer, MultiOpt({"opt": make(list(layer.named_parameters()))})

    def step(layer, opt):
        layer(torch.arange(6.0).reshape(2, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    layer, opt = build()
    step(layer, opt)
    saved, weights = roundtrip(opt.state_dict()), {k: v.clone() for k, v in layer.state_dict().items()}
    step(layer, opt)
    resumed, resumed_opt = build()
    resumed.load_state_dict(weights)
    resumed_opt.load_state_dict(saved)
    step(resumed, resumed_opt)
    for (name, a), b in zip(layer.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    damaged = roundtrip(opt.state_dict())
    entry = damaged["opt"]["state"]["weight"]
    missing = sorted(entry)[0]
    del entry[missing]
    with pytest.raises(OptimError, match=f"lacks state '{missing}'"):
        build()[1].load_state_dict(damaged)


def test_a_torch_scheduler_puts_back_the_lr_it_had_set_when_loaded(roundtrip):
    """A torch LR scheduler sets its optimizer's lr when it steps, not when it loads: after a load
    the live group holds the lr of the saved state (else the next step trains at the initial lr)."""
    def build():
        w = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([("w", w)], lr=1.0)
        return opt, MultiSched({"sgd": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))})

    opt, sched = build()
    for _ in range(3):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.25
    fresh_opt, fresh = build()
    fresh.load_state_dict(roundtrip(sched.state_dict()))
    assert fresh_opt.param_groups[0]["lr"] == 0.25 and fresh.get_last_lr() == {"sgd": [0.25]}
    fresh.step(["other"])  # only the schedulers of the optimizers that stepped advance
    assert fresh.get_last_lr() == {"sgd": [0.25]}
    fresh.step(["sgd"])
    assert fresh.get_last_lr() == {"sgd": [0.2]}


@pytest.mark.parametrize("make, saved, built", [
    (Muon, dict(lr=0.02, momentum=0.95, ns_steps=5, weight_decay=0.0),
     dict(lr=0.01, momentum=0.9, ns_steps=3, weight_decay=0.1)),
    (Lion, dict(lr=1e-3, betas=(0.9, 0.99), wd=0.0), dict(lr=2e-3, betas=(0.8, 0.9), wd=0.1)),
    (OLion, dict(lr=1e-3, gamma=0.2), dict(lr=2e-3, gamma=0.5)),
    (Adafactor2D, dict(beta2=0.999, eps=1e-30, clip=1.0), dict(beta2=0.99, eps=1e-8, clip=2.0)),
    (torch.optim.RMSprop, dict(alpha=0.99, eps=1e-8), dict(alpha=0.9, eps=1e-6)),
])
def test_every_hyperparameter_of_an_optimizer_is_the_built_one_and_named_when_it_differs(make, saved, built, roundtrip):
    """No scheduler drives these groups: each hyperparameter, the lr included, is compared."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = MultiOpt({"o": make([("w", w)], **saved)})
    w.grad = torch.randn(4, 3)
    opt.step()
    state = roundtrip(opt.state_dict())
    again = MultiOpt({"o": make([("w", w)], **built)})
    again.load_state_dict(state)
    assert again.hyperparameter_changes == {f"o/{k}": (list(v) if isinstance(v, tuple) else v,
                                                       list(built[k]) if isinstance(v, tuple) else built[k])
                                            for k, v in sorted(saved.items())}
    assert all(again.optimizers["o"].param_groups[0][k] == v for k, v in built.items())
    same = MultiOpt({"o": make([("w", w)], **saved)})
    same.load_state_dict(state)
    assert same.hyperparameter_changes == {}
