"""Exact resume at the optimizer level, for every arm, through safetensors + JSON (no pickle):
k steps, checkpoint, a fresh model and bundle, load, n more steps == an uninterrupted k+n run."""

import pytest
import torch

from optim.build import build_bundle
from optim.config import parse_optim_config

K, N, TOTAL = 3, 3, 8
ARMS = {
    "adamw": {},
    "muon": {"type": "muon"},
    "muon-knobs": {"type": "muon", "consistent_rms": 0.2, "ns_dtype": "bfloat16",
                   "muon_weight_decay": 0.1, "nesterov": False},
    "lion": {"type": "lion", "wd": 0.1},
    "olion": {"type": "olion", "wd": 0.1},
    "adafactor": {"type": "adafactor", "lr_matrix": 1e-2},
    "sgdm": {"type": "sgdm", "lr": 0.05},
    "muon-head": {"type": "muon", "head_lr_mult": 2.0, "head_pattern": "head.*"},
}


def sorted_groups(state):
    """The bundle state with each group's parameter list sorted (it follows registration order)."""
    for opt in state.values():
        for group in opt["param_groups"]:
            group["params"] = sorted(group["params"])
    return state


# bfloat16 parameters for the arms whose state dtype policies differ (Adafactor keeps float32
# statistics, which torch's loader would otherwise cast to the parameter dtype).
CASES = [(arm, torch.float32) for arm in ARMS] + [
    (arm, torch.bfloat16) for arm in ("adamw", "muon", "adafactor")]


@pytest.mark.parametrize(("arm", "dtype"), CASES, ids=[f"{a}-{str(d)[6:]}" for a, d in CASES])
def test_resume_is_bitwise_the_uninterrupted_run(arm, dtype, tiny_gpt, train, roundtrip, tree_equal):
    cfg = parse_optim_config({"lr": 1e-3, "warmup": 2, **ARMS[arm]})

    whole = tiny_gpt(seed=0).to(dtype)
    whole_opt, whole_sched = build_bundle(cfg, whole, TOTAL)
    train(whole, whole_opt, whole_sched, 0, K + N)

    first = tiny_gpt(seed=0).to(dtype)
    opt, sched = build_bundle(cfg, first, TOTAL)
    train(first, opt, sched, 0, K)
    ckpt = roundtrip({"model": first.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()})
    del first, opt, sched

    # Another init and another parameter registration order: only names may tie state to tensors.
    resumed = tiny_gpt(seed=1, reverse=True).to(dtype)
    resumed.load_state_dict(ckpt["model"])
    opt, sched = build_bundle(cfg, resumed, TOTAL)
    opt.load_state_dict(ckpt["optim"])
    sched.load_state_dict(ckpt["sched"])
    assert opt.restored_with_changes == [] and sched.restored_with_changes == []
    train(resumed, opt, sched, K, N)

    params = dict(resumed.named_parameters())
    for name, p in whole.named_parameters():
        assert p.dtype == params[name].dtype and torch.equal(p, params[name]), name
    tree_equal(sorted_groups(opt.state_dict()), sorted_groups(whole_opt.state_dict()))
    tree_equal(sched.state_dict(), whole_sched.state_dict())
