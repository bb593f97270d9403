"""MultiSched with torch's schedulers: a load takes the progress from the checkpoint and every
setting from the scheduler as built; an unchanged one resumes bitwise, a changed one as the
scheduler built would be at the restored step, each change named with both values."""

import pytest
import torch
from torch.optim import lr_scheduler as L

from optim.errors import OptimError
from optim.schedulers import MultiSched, bundle

# Every torch scheduler the harness steps (all but ReduceLROnPlateau), over an SGD with momentum.
SCHEDULERS = {
    "LambdaLR": lambda o, lr: L.LambdaLR(o, lambda s: 0.9 ** s),
    "MultiplicativeLR": lambda o, lr: L.MultiplicativeLR(o, lambda s: 0.9),
    "StepLR": lambda o, lr: L.StepLR(o, 2),
    "MultiStepLR": lambda o, lr: L.MultiStepLR(o, [2, 4, 7]),
    "ConstantLR": lambda o, lr: L.ConstantLR(o, total_iters=6),
    "LinearLR": lambda o, lr: L.LinearLR(o, total_iters=6),
    "ExponentialLR": lambda o, lr: L.ExponentialLR(o, 0.9),
    "PolynomialLR": lambda o, lr: L.PolynomialLR(o, 12),
    "CosineAnnealingLR": lambda o, lr: L.CosineAnnealingLR(o, 5),
    "CosineAnnealingWarmRestarts": lambda o, lr: L.CosineAnnealingWarmRestarts(o, 2, 2),
    "CyclicLR": lambda o, lr: L.CyclicLR(o, lr / 10, lr, 2),  # cycles the momentum too
    "OneCycleLR": lambda o, lr: L.OneCycleLR(o, lr, total_steps=20),
    "SequentialLR": lambda o, lr: L.SequentialLR(o, [L.ConstantLR(o, total_iters=2), L.ExponentialLR(o, 0.9)], [3]),
    "ChainedScheduler": lambda o, lr: L.ChainedScheduler([L.ConstantLR(o, total_iters=3), L.ExponentialLR(o, 0.9)]),
}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch's warnings about its own schedulers' args


def build(kind: str, lr: float):
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([("w", w)], lr=lr, momentum=0.9)
    return w, *bundle({"sgd": opt}, {"sgd": SCHEDULERS[kind](opt, lr)})


def steps(w, opt, sched, n: int, first: int = 0) -> list[tuple[float, float]]:
    """`n` steps; the (lr, momentum) each trained with."""
    used = []
    for i in range(first, first + n):
        w.grad = torch.full_like(w, float(i + 1))
        used.append((opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
        opt.step()
        sched.step()
    return used


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_an_unchanged_scheduler_resumes_bitwise(kind, roundtrip):
    w, opt, sched = build(kind, 0.1)
    whole = steps(w, opt, sched, 5) + steps(w, opt, sched, 5, first=5)
    w, opt, sched = build(kind, 0.1)
    steps(w, opt, sched, 5)
    saved = roundtrip(opt.state_dict()), roundtrip(sched.state_dict())
    w, opt, sched = build(kind, 0.1)
    opt.load_state_dict(saved[0])
    sched.load_state_dict(saved[1])
    assert opt.hyperparameter_changes == {} and sched.hyperparameter_changes == {}
    assert steps(w, opt, sched, 5, first=5) == whole[5:]


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_a_changed_lr_resumes_as_the_scheduler_built_with_it_from_the_start(kind, roundtrip):
    w, opt, sched = build(kind, 0.05)
    fresh = steps(w, opt, sched, 10)
    w, opt, sched = build(kind, 0.1)
    steps(w, opt, sched, 5)
    saved = roundtrip(opt.state_dict()), roundtrip(sched.state_dict())
    w, opt, sched = build(kind, 0.05)
    opt.load_state_dict(saved[0])
    sched.load_state_dict(saved[1])
    assert "sgd/initial_lr" in opt.hyperparameter_changes  # the peak lr, or the lr a cycle starts from
    assert sched.hyperparameter_changes and sched.restored_with_changes == sorted(sched.hyperparameter_changes)
    assert steps(w, opt, sched, 5, first=5) == fresh[5:]


def test_a_changed_setting_is_named_with_both_values_and_the_built_one_is_in_force(roundtrip):
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([("w", w)], lr=1.0)
    multi_opt, multi_sched = bundle({"sgd": opt}, {"sgd": L.StepLR(opt, step_size=4, gamma=0.5)})
    steps(w, multi_opt, multi_sched, 5)
    saved = roundtrip(multi_opt.state_dict()), roundtrip(multi_sched.state_dict())
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([("w", w)], lr=1.0)
    multi_opt, multi_sched = bundle({"sgd": opt}, {"sgd": L.StepLR(opt, step_size=2, gamma=0.5)})
    multi_opt.load_state_dict(saved[0])
    multi_sched.load_state_dict(saved[1])
    assert multi_sched.hyperparameter_changes == {"sgd/step_size": (4, 2)}
    # Step 6 with step_size 2 is in its third period: 1.0 * 0.5 ** 2 (the saved state had 0.5).
    assert opt.param_groups[0]["lr"] == 0.25 and multi_sched.schedulers["sgd"].step_size == 2


def test_a_lambdalr_whose_lambdas_changed_is_named_by_their_effect(roundtrip):
    def build_with(warmup: int):
        w = torch.nn.Parameter(torch.zeros(3))
        opt = torch.optim.SGD([("w", w)], lr=1.0)
        return (w, *bundle({"sgd": opt}, {"sgd": L.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))}))

    w, opt, sched = build_with(4)
    steps(w, opt, sched, 2)
    saved = roundtrip(opt.state_dict()), roundtrip(sched.state_dict())
    w, opt, sched = build_with(8)
    opt.load_state_dict(saved[0])
    sched.load_state_dict(saved[1])
    assert sched.hyperparameter_changes == {"sgd/lr at step 2 (lr_lambdas)": ([0.75], [0.375])}
    assert opt.param_groups[0]["lr"] == 0.375
    w, opt, sched = build_with(4)
    opt.load_state_dict(saved[0])
    sched.load_state_dict(saved[1])
    assert sched.hyperparameter_changes == {} and opt.param_groups[0]["lr"] == 0.75


def test_an_optimizer_without_a_scheduler_compares_its_lr():
    w = torch.nn.Parameter(torch.zeros(3))
    saved = bundle({"sgd": torch.optim.SGD([("w", w)], lr=0.1)}, {})[0].state_dict()
    multi_opt, _ = bundle({"sgd": torch.optim.SGD([("w", w)], lr=0.2)}, {})
    multi_opt.load_state_dict(saved)
    assert multi_opt.hyperparameter_changes == {"sgd/lr": (0.1, 0.2)}
    assert multi_opt.optimizers["sgd"].param_groups[0]["lr"] == 0.2


def test_schedulers_the_bundle_cannot_resume_or_misnamed_are_refused():
    w = torch.nn.Parameter(torch.zeros(3))
    a, b = torch.optim.SGD([("w", w)], lr=0.1), torch.optim.SGD([("v", torch.nn.Parameter(torch.zeros(1)))], lr=0.1)
    with pytest.raises(TypeError, match="'a' is a ReduceLROnPlateau"):
        bundle({"a": a}, {"a": L.ReduceLROnPlateau(a)})
    with pytest.raises(ValueError, match="scheduler 'a' drives another optimizer than 'a'"):
        bundle({"a": a, "b": b}, {"a": L.StepLR(b, 2)})
    with pytest.raises(ValueError, match="scheduler 'c' has no optimizer of that name"):
        bundle({"a": a}, {"c": L.StepLR(a, 2)})


def test_a_scheduler_state_without_its_progress_is_refused_before_any_load():
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([("w", w)], lr=0.1)
    sched = MultiSched({"sgd": L.StepLR(opt, 2)})
    state = sched.state_dict()
    del state["sgd"]["last_epoch"]
    with pytest.raises(OptimError, match=r"sched/sgd is malformed: it lacks \['last_epoch'\]"):
        sched.load_state_dict(state)
