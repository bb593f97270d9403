"""The schedule: the reference's warmup + cosine value for value, linear and WSD shapes, and what
a resume with a changed schedule does (re-planned without an lr jump, replayed on later resumes)."""

import math

import pytest
import torch

from optim.schedule import Anchor, Schedule, ScheduledLR, replan


def reference_multiplier(warmup, total_steps, lr_min_ratio):
    """The reference build_hybrid/build_alt lambda, verbatim."""
    if total_steps > 0:
        def fn(s):
            if s < warmup:
                return (s + 1) / max(warmup, 1)
            p = min(1.0, (s - warmup) / max(1, total_steps - warmup))
            return lr_min_ratio + 0.5 * (1 - lr_min_ratio) * (1 + math.cos(math.pi * p))
    else:
        def fn(s):
            return min(1.0, (s + 1) / max(warmup, 1))
    return fn


@pytest.mark.parametrize(("warmup", "total", "ratio"),
                         [(0, 0, 0.1), (5, 0, 0.1), (0, 20, 0.1), (5, 20, 0.1), (5, 20, 0.0),
                          (20, 20, 0.3), (30, 20, 0.1), (5, 20, 1.0)])
def test_cosine_equals_the_reference_at_every_step(warmup, total, ratio):
    ours, ref = Schedule("cosine", warmup, total, ratio), reference_multiplier(warmup, total, ratio)
    assert [ours.multiplier(s) for s in range(40)] == [ref(s) for s in range(40)]


def test_shapes():
    cos = Schedule("cosine", 4, 14, 0.1)
    assert [cos.multiplier(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos.multiplier(9) == pytest.approx(0.55)
    assert cos.multiplier(14) == cos.multiplier(100) == pytest.approx(0.1)
    assert [Schedule("cosine", 2, 0, 0.1).multiplier(s) for s in (0, 1, 50)] == [0.5, 1.0, 1.0]
    lin = Schedule("linear", 2, 12, 0.2)
    assert [lin.multiplier(s) for s in (0, 2, 7, 12, 30)] == pytest.approx([0.5, 1.0, 0.6, 0.2, 0.2])
    # WSD over 2 + 10 steps with the last 40 % decaying: peak up to step 8, then linear to 0.1 at 12.
    wsd = Schedule("wsd", 2, 12, 0.1, decay_fraction=0.4)
    assert [wsd.multiplier(s) for s in range(13)] == pytest.approx(
        [0.5, 1, 1, 1, 1, 1, 1, 1, 1, 0.775, 0.55, 0.325, 0.1])
    assert wsd.multiplier(100) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="unknown schedule kind"):
        Schedule("step")


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd"])
def test_curve_and_progress_at_are_inverse(kind):
    s = Schedule(kind, 0, 10, 0.1, 0.5)
    for p in (0.55, 0.7, 0.95, 1.0):
        assert s.curve(s.progress_at(s.curve(p))) == pytest.approx(s.curve(p), abs=1e-12)


def test_extending_a_finished_cosine_run_keeps_the_minimum_lr():
    """20 -> 30 steps after step 20: the cosine had ended at lr_min_ratio, so the tail stays there
    (without the re-plan the new cosine would put step 21 at 0.31, a jump from 0.1)."""
    old, new = Schedule("cosine", 2, 20, 0.1), Schedule("cosine", 2, 30, 0.1)
    anchor = replan(old, None, 20, new)
    assert anchor == Anchor(20, 1.0)
    assert [new.multiplier(s, anchor) for s in range(20, 31)] == pytest.approx([0.1] * 11)
    assert new.multiplier(21) == pytest.approx(0.311, abs=1e-3)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
@pytest.mark.parametrize(("old_total", "new_total"), [(20, 30), (20, 14)])
def test_a_mid_run_change_of_length_continues_the_curve_to_the_new_end(kind, old_total, new_total):
    old, new = Schedule(kind, 2, old_total, 0.1), Schedule(kind, 2, new_total, 0.1)
    anchor = replan(old, None, 10, new)
    values = [new.multiplier(s, anchor) for s in range(10, new_total + 1)]
    assert values[0] == pytest.approx(old.multiplier(10), abs=1e-12)  # no jump at the resumed step
    assert all(a > b for a, b in zip(values, values[1:], strict=False))  # still decaying...
    assert values[-1] == pytest.approx(0.1)  # ...to the minimum at the new end


def test_wsd_extended_in_its_stable_phase_moves_the_decay_to_the_new_end():
    old, new = Schedule("wsd", 0, 20, 0.1, 0.25), Schedule("wsd", 0, 40, 0.1, 0.25)
    assert replan(old, None, 10, new) is None  # both are at the peak there: the new plan as is
    assert [new.multiplier(s) for s in (10, 30, 35, 40)] == pytest.approx([1, 1, 0.55, 0.1])
    # Cut short into what would already be its decay: the decay starts at the resumed step.
    cut = Schedule("wsd", 0, 12, 0.1, 0.25)
    anchor = replan(old, None, 10, cut)
    assert [cut.multiplier(s, anchor) for s in (10, 11, 12)] == pytest.approx([1, 0.55, 0.1])


def test_no_change_keeps_the_saved_anchor_and_a_constant_or_warmup_resume_drops_it():
    s, anchor = Schedule("cosine", 2, 30, 0.1), Anchor(20, 1.0)
    assert replan(s, anchor, 25, s) is anchor
    assert replan(s, anchor, 25, Schedule("cosine", 2, 0, 0.1)) is None
    assert replan(s, None, 1, Schedule("cosine", 5, 30, 0.1)) is None


def scheduler(schedule, peak=1.0):
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=peak)
    return ScheduledLR(opt, schedule), opt


def steps(sched, opt, n):
    for _ in range(n):
        opt.step()
        sched.step()


def test_state_round_trip_is_bitwise_and_replays_the_anchor():
    """Run 12 steps under 20, resume under 30 (re-planned), save at 16, resume again under 30:
    the second resume replays the anchor instead of re-planning, so it equals the first."""
    short, long = Schedule("cosine", 2, 20, 0.1), Schedule("cosine", 2, 30, 0.1)
    a, opt_a = scheduler(short)
    steps(a, opt_a, 12)
    b, opt_b = scheduler(long)
    b.load_state_dict(a.state_dict())
    assert b.replanned["step"] == 12 and b.replanned["from"]["total_steps"] == 20
    assert opt_b.param_groups[0]["lr"] == pytest.approx(opt_a.param_groups[0]["lr"], abs=1e-12)
    steps(b, opt_b, 4)
    c, opt_c = scheduler(long)
    c.load_state_dict(b.state_dict())
    assert c.replanned is None and c.state_dict() == b.state_dict()
    assert opt_c.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    steps(b, opt_b, 5)
    steps(c, opt_c, 5)
    assert c.get_last_lr() == b.get_last_lr()


def test_a_new_peak_lr_scales_the_same_multiplier_from_the_restored_step():
    sched = Schedule("cosine", 2, 20, 0.1)
    a, opt_a = scheduler(sched, peak=1.0)
    steps(a, opt_a, 7)
    b, opt_b = scheduler(sched, peak=0.25)
    b.load_state_dict(a.state_dict())
    assert b.replanned is None
    assert opt_b.param_groups[0]["lr"] == 0.25 * sched.multiplier(7)
    assert b.last_epoch == 7 and b.base_lrs == [0.25]


def test_a_lambdalr_state_from_before_schedules_were_saved_loads_with_the_same_lrs():
    """Checkpoints written with torch's LambdaLR (no schedule recorded): the counters are taken,
    the lrs come out the same, and the load says the schedule was not recorded."""
    schedule = Schedule("cosine", 2, 20, 0.1)
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    legacy = torch.optim.lr_scheduler.LambdaLR(opt, schedule.multiplier)
    steps(legacy, opt, 7)
    state = {k: v for k, v in legacy.state_dict().items() if k != "lr_lambdas"}
    ours, ours_opt = scheduler(schedule)
    ours.load_state_dict(state)
    assert ours.get_last_lr() == legacy.get_last_lr() and ours.last_epoch == 7
    assert ours.restored_with_changes == ["schedule not recorded"] and ours.replanned is None
    steps(legacy, opt, 3)
    steps(ours, ours_opt, 3)
    assert ours.get_last_lr() == legacy.get_last_lr()
