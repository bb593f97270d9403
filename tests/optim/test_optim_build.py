"""Optimizer config and build_bundle: the union, the split, the knobs, the AdamW default bit for bit."""

import math

import pydantic
import pytest
import torch

from optim import config
from optim.adafactor import Adafactor2D
from optim.build import build_bundle
from optim.config import parse_optim_config
from optim.errors import OptimError
from optim.lion import Lion
from optim.muon import Muon
from optim.olion import OLion

ARMS = ["adamw", "muon", "lion", "olion", "adafactor", "sgdm"]
MEMBERS = [config.AdamWConfig, config.MuonConfig, config.LionConfig, config.OLionConfig,
           config.AdafactorConfig, config.SGDMConfig]


def names(opt):
    return sorted(n for g in opt.param_groups for n in g["param_names"])


def test_config_without_type_is_adamw_with_the_reference_defaults():
    cfg = parse_optim_config({"lr": 1e-3})
    assert isinstance(cfg, config.AdamWConfig) and cfg.type == "adamw"
    assert (cfg.weight_decay, cfg.adam_betas, cfg.lr_min_ratio, cfg.total_steps) == (1e-4, (0.9, 0.999), 0.1, None)
    muon = parse_optim_config({"type": "muon"})
    assert (muon.lr_muon, muon.momentum, muon.nesterov, muon.ns_steps, muon.consistent_rms,
            muon.ns_dtype, muon.muon_weight_decay) == (0.02, 0.95, True, 5, None, "auto", 0.0)
    assert parse_optim_config({"type": "olion"}).gamma == 0.2


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_parses_and_rejects_unknown_keys(arm):
    assert parse_optim_config({"type": arm}).type == arm
    with pytest.raises(pydantic.ValidationError, match="lr_muonn"):
        parse_optim_config({"type": arm, "lr_muonn": 0.1})


def test_unknown_type_and_bad_values_are_rejected():
    with pytest.raises(pydantic.ValidationError):
        parse_optim_config({"type": "adam"})
    with pytest.raises(pydantic.ValidationError, match="ns_dtype"):
        parse_optim_config({"type": "muon", "ns_dtype": "float16"})
    with pytest.raises(pydantic.ValidationError, match="head_pattern"):
        parse_optim_config({"head_lr_mult": 2.0})


@pytest.mark.parametrize("member", MEMBERS)
def test_every_field_is_documented_and_extra_is_forbidden(member):
    assert member.model_config["extra"] == "forbid"
    assert all(f.description for f in member.model_fields.values())


def test_the_union_works_as_a_field_type():
    class Run(pydantic.BaseModel):
        optim: config.OptimConfig = pydantic.Field(default_factory=config.AdamWConfig)

    assert isinstance(Run().optim, config.AdamWConfig)
    assert isinstance(Run(optim={"type": "lion", "wd": 0.1}).optim, config.LionConfig)
    assert isinstance(Run(optim={}).optim, config.AdamWConfig)


def test_untyped_config_decaying_everything_reproduces_plain_adamw_and_lambdalr_bit_for_bit(tiny_gpt, train):
    cfg = parse_optim_config({"lr": 2e-3, "warmup": 2, "weight_decay": 0.05, "decay_1d": True,
                              "decay_embeddings": True, "adam_betas": [0.85, 0.98], "lr_min_ratio": 0.2})
    ours = tiny_gpt()
    opt, sched = build_bundle(cfg, ours, total_steps=6)
    plain = tiny_gpt()
    adamw = torch.optim.AdamW(plain.parameters(), lr=2e-3, betas=(0.85, 0.98), weight_decay=0.05)

    def fn(s):
        if s < 2:
            return (s + 1) / 2
        p = min(1.0, (s - 2) / max(1, 6 - 2))
        return 0.2 + 0.5 * (1 - 0.2) * (1 + math.cos(math.pi * p))

    lambdalr = torch.optim.lr_scheduler.LambdaLR(adamw, fn)
    train(ours, opt, sched, 0, 7)
    train(plain, adamw, lambdalr, 0, 7)
    for (n, a), b in zip(ours.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b), n
    for p, q in zip(ours.parameters(), plain.parameters(), strict=True):
        st, ref = opt.optimizers["adamw"].state[p], adamw.state[q]
        assert all(torch.equal(st[k], ref[k]) for k in ref)
    assert list(opt.optimizers) == ["adamw"]


def no_decay_names(opt):
    return sorted(n for g in opt.param_groups if g["weight_decay"] == 0.0 for n in g["param_names"])


@pytest.mark.parametrize("arm", ["adamw", "muon", "lion", "olion", "adafactor"])
def test_adamw_does_not_decay_1d_parameters_or_embeddings_by_default(tiny_gpt, train, arm):
    model = tiny_gpt()
    opt, sched = build_bundle(parse_optim_config({"type": arm, "weight_decay": 0.1}), model, 10)
    adamw = opt.optimizers["adamw"]
    exempt = sorted(n for n, p in model.named_parameters() if p.ndim < 2) + ["emb.weight"]
    assert no_decay_names(adamw) == sorted(exempt)
    assert all(g["weight_decay"] == 0.1 for g in adamw.param_groups if g["weight_decay"])
    # With zero gradients only decay moves a parameter: the exempt ones stay where they were.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    moved = sorted(n for n, p in model.named_parameters() if not torch.equal(p, before[n]))
    assert "head.weight" in moved and not set(moved) & set(exempt)
    everything = parse_optim_config({"type": arm, "decay_1d": True, "decay_embeddings": True})
    assert no_decay_names(build_bundle(everything, tiny_gpt(), 10)[0].optimizers["adamw"]) == []
    only_1d = build_bundle(parse_optim_config({"type": arm, "decay_embeddings": True}), tiny_gpt(), 10)[0]
    assert no_decay_names(only_1d.optimizers["adamw"]) == sorted(set(exempt) - {"emb.weight"})


def test_decay_split_keeps_the_head_groups_order(tiny_gpt):
    cfg = parse_optim_config({"lr": 1e-3, "head_lr_mult": 2.0, "head_pattern": "head.*"})
    groups = build_bundle(cfg, tiny_gpt(), 10)[0].optimizers["adamw"].param_groups
    assert [(g["initial_lr"], g["weight_decay"] > 0) for g in groups] == [(1e-3, True), (1e-3, False), (2e-3, True)]


@pytest.mark.parametrize(("arm", "cls"), [("muon", Muon), ("lion", Lion), ("olion", OLion),
                                          ("adafactor", Adafactor2D)])
def test_default_split_is_the_2d_block_parameters(tiny_gpt, arm, cls):
    model = tiny_gpt()
    opt, sched = build_bundle(parse_optim_config({"type": arm}), model, 10)
    assert list(opt.optimizers) == [arm, "adamw"] and list(sched.schedulers) == [arm, "adamw"]
    assert isinstance(opt.optimizers[arm], cls)
    blocks = sorted(n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2)
    assert names(opt.optimizers[arm]) == blocks
    assert names(opt.optimizers["adamw"]) == sorted(set(n for n, _ in model.named_parameters()) - set(blocks))
    assert len(opt.param_groups) == 3  # the matrices; AdamW's decayed and not decayed rest


def test_matrix_patterns_choose_the_matrices_and_only_2d_ones(tiny_gpt):
    model = tiny_gpt()
    cfg = parse_optim_config({"type": "lion", "matrix_patterns": ["blocks.*.fc.*", "head.*", "ln_f.*"]})
    opt, _ = build_bundle(cfg, model, 10)
    assert names(opt.optimizers["lion"]) == ["blocks.0.fc.weight", "blocks.1.fc.weight", "head.weight"]
    with pytest.raises(OptimError, match=r"match no 2D parameter"):
        build_bundle(parse_optim_config({"type": "muon", "matrix_patterns": ["block.*"]}), model, 10)


def test_knobs_reach_the_optimizers(tiny_gpt):
    model = tiny_gpt()
    opt, _ = build_bundle(parse_optim_config(
        {"type": "muon", "lr_muon": 0.05, "momentum": 0.9, "nesterov": False, "ns_steps": 6,
         "consistent_rms": 0.2, "ns_dtype": "bfloat16", "muon_weight_decay": 0.1, "lr": 1e-3}), model, 10)
    g = opt.optimizers["muon"].param_groups[0]
    assert (g["initial_lr"], g["momentum"], g["nesterov"], g["ns_steps"], g["consistent_rms"],
            g["ns_dtype"], g["weight_decay"]) == (0.05, 0.9, False, 6, 0.2, "bfloat16", 0.1)
    assert opt.optimizers["adamw"].param_groups[0]["initial_lr"] == 1e-3
    opt, _ = build_bundle(parse_optim_config({"type": "olion", "lr": 1e-3, "gamma": 0.3, "wd": 0.1}), model, 10)
    g = opt.optimizers["olion"].param_groups[0]
    assert (g["initial_lr"], g["gamma"], g["wd"]) == (1e-3, 0.3, 0.1)
    opt, _ = build_bundle(parse_optim_config({"type": "adafactor", "lr_matrix": 0.01}), model, 10)
    assert opt.optimizers["adafactor"].param_groups[0]["initial_lr"] == 0.01


def test_sgdm_is_nesterov_sgd_on_everything(tiny_gpt):
    model = tiny_gpt()
    opt, _ = build_bundle(parse_optim_config({"type": "sgdm", "lr": 0.1}), model, 10)
    (sgd,) = opt.optimizers.values()
    assert isinstance(sgd, torch.optim.SGD) and list(opt.optimizers) == ["sgdm"]
    assert names(sgd) == sorted(n for n, _ in model.named_parameters())
    assert (sgd.param_groups[0]["momentum"], sgd.param_groups[0]["nesterov"]) == (0.95, True)


@pytest.mark.parametrize("arm", ["adamw", "muon", "sgdm"])
def test_head_lr_mult_scales_the_head_group(tiny_gpt, arm):
    model = tiny_gpt()
    cfg = parse_optim_config({"type": arm, "lr": 1e-3, "head_lr_mult": 3.0, "head_pattern": "head.*"})
    opt, sched = build_bundle(cfg, model, 10)
    holder = opt.optimizers["sgdm" if arm == "sgdm" else "adamw"]
    rest, head = holder.param_groups[0], holder.param_groups[-1]
    assert head["param_names"] == ["head.weight"] and "head.weight" not in rest["param_names"]
    assert (rest["initial_lr"], head["initial_lr"]) == (1e-3, 3e-3)
    with pytest.raises(OptimError, match="'lm_head'"):
        build_bundle(parse_optim_config({"head_lr_mult": 2.0, "head_pattern": "lm_head"}), model, 10)


@pytest.mark.parametrize(("cfg_total", "arg_total", "lr_at_10"),
                         [(None, 10, 0.1), (0, 10, 1.0), (20, 10, 0.55)])
def test_total_steps_comes_from_the_config_else_the_run(tiny_gpt, cfg_total, arg_total, lr_at_10):
    opt, sched = build_bundle(parse_optim_config({"lr": 1.0, "total_steps": cfg_total}), tiny_gpt(), arg_total)
    for _ in range(10):
        opt.step()
        sched.step()
    assert sched.get_last_lr()["adamw"] == [pytest.approx(lr_at_10)] * 2  # decayed and not decayed


# A value other than the default for every [optim] key, and the keys it needs beside it to act.
OTHER = {"lr": 1e-2, "warmup": 3, "schedule": "linear", "decay_fraction": 0.5, "total_steps": 7, "lr_min_ratio": 0.5,
         "head_lr_mult": 2.0, "head_pattern": "emb.*", "weight_decay": 0.3, "decay_1d": True,
         "decay_embeddings": True, "adam_betas": (0.8, 0.9), "matrix_patterns": ["blocks.0.*"], "lr_muon": 0.05,
         "momentum": 0.5, "nesterov": False, "ns_steps": 3, "consistent_rms": 0.2, "ns_dtype": "bfloat16",
         "muon_weight_decay": 0.1, "lr_matrix": 0.05, "wd": 0.1, "gamma": 0.5}
NEEDS = {"decay_fraction": {"schedule": "wsd"}, "head_lr_mult": {"head_pattern": "head.*"},
         "head_pattern": {"head_lr_mult": 2.0, "head_pattern": "head.*"}}


def _built(tiny_gpt, settings: dict) -> tuple:
    """What a bundle does with `settings`: each optimizer's groups (parameters and every
    hyperparameter) and the lrs its schedule sets over 10 steps."""
    opt, sched = build_bundle(parse_optim_config(settings), tiny_gpt(), 10)
    groups = {name: [sorted((k, repr(v)) for k, v in g.items() if k != "params") for g in o.param_groups]
              for name, o in opt.optimizers.items()}
    lrs = []
    for _ in range(10):
        sched.step()
        lrs.append(sched.get_last_lr())
    return groups, lrs


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # the schedule alone is stepped
@pytest.mark.parametrize("arm, key", [(arm, key) for arm, member in zip(ARMS, MEMBERS, strict=True)
                                      for key in member.model_fields if key != "type"])
def test_every_key_of_an_arm_changes_what_it_builds(tiny_gpt, arm, key):
    """A key an arm's config has is one its bundle uses (an arm that would ignore a key does not
    have it: setting it is refused at load), so another value builds another bundle."""
    base = {"type": arm, **NEEDS.get(key, {})}
    assert _built(tiny_gpt, {**base, key: OTHER[key]}) != _built(tiny_gpt, base)


@pytest.mark.parametrize("key", ["weight_decay", "adam_betas", "decay_1d", "decay_embeddings", "matrix_patterns"])
def test_sgdm_refuses_the_keys_of_adamw_and_the_split(key):
    with pytest.raises(pydantic.ValidationError, match=key):
        parse_optim_config({"type": "sgdm", key: OTHER[key]})
    assert "sgdm" not in config.arms_taking(key)
