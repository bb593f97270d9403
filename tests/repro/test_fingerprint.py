"""Fingerprint records, the history part and the trainer's own resume check (in-process)."""

from __future__ import annotations

import pytest
import torch

from harness.checkpoint import CheckpointStore, Verify, load
from harness.records.metrics import MetricsLog
from harness.repro import fingerprint
from harness.repro.fingerprint import FingerprintLog, ResumeDiverged, batch_hash, diagnose, part_hashes, state_digests


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict]] = []

    def emit(self, kind: str, **fields) -> None:
        self.emitted.append((kind, fields))


def make_log(every: int = 2, on_divergence: str = "warn"):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, FingerprintLog(lambda: {"model": model, "optim": opt}, every, on_divergence)


def step(model, opt, fp: FingerprintLog, n: int) -> dict:
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    return fp.take(n, 0.5 * n, {"sample_ids": torch.tensor([n, n + 1])}, [0.1])


def test_batch_hash_is_the_sample_ids_in_order():
    assert batch_hash({"sample_ids": torch.tensor([1, 2])}) == batch_hash({"sample_ids": [1, 2]})
    assert batch_hash({"sample_ids": torch.tensor([1, 2])}) != batch_hash({"sample_ids": torch.tensor([2, 1])})
    assert batch_hash((torch.ones(2), torch.zeros(2))) != batch_hash((torch.zeros(2), torch.ones(2)))


def test_state_hash_every_n_steps_sees_live_optimizer_buffers():
    model, opt, fp = make_log(every=2)
    first, second = step(model, opt, fp, 1), step(model, opt, fp, 2)
    assert "state_hash" not in first and set(second["state_hash"]) == {"model", "optim"}
    assert any(k.endswith("/momentum_buffer") for k in fp.tensors["optim"])
    for s in opt.state.values():
        s["momentum_buffer"].add_(1.0)  # only a buffer changes
    after = part_hashes(state_digests({"model": model, "optim": opt}))
    assert after["model"] == second["state_hash"]["model"] and after["optim"] != second["state_hash"]["optim"]


def test_history_round_trips_and_checks_the_restored_state():
    model, opt, fp = make_log()
    for n in (1, 2):
        step(model, opt, fp, n)
    saved = fp.state_dict()
    _, _, again = make_log()  # a fresh model: not what was saved
    again.load_state_dict(saved)
    assert again.records == fp.records
    events = Events()
    again.watch(events, [])
    assert events.emitted[0][0] == "resume_mismatch"
    assert events.emitted[0][1]["fields"] == ["restored:optim", "restored:model"]


def test_a_part_restored_with_changes_on_purpose_is_not_compared():
    """The optimizer bundle under `--allow-config-change` loads other hyperparameters than it
    saved and says so (`restored_with_changes`): no false `restored:optim` alarm, the rest checked."""
    model, opt, fp = make_log()
    step(model, opt, fp, 1)
    saved = fp.state_dict()
    other_opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # another lr, no momentum yet
    other_opt.restored_with_changes = ["sgd/lr"]
    again = FingerprintLog(lambda: {"model": model, "optim": other_opt}, 2)
    again.load_state_dict(saved)
    events = Events()
    again.watch(events, [])
    assert events.emitted == []
    model.weight.data.add_(1.0)
    again.load_state_dict(saved)
    again.watch(events, [])
    assert events.emitted[0][1]["fields"] == ["restored:model"]


@pytest.mark.parametrize("policy", ["warn", "error"])
def test_a_rerun_step_that_differs_is_reported_at_once(policy):
    model, opt, fp = make_log(every=1, on_divergence=policy)
    events = Events()
    fp.watch(events, [{"step": 1, "loss": 0.5, "batch_hash": batch_hash({"sample_ids": [1, 2]})},
                      {"step": 2, "loss": 99.0, "batch_hash": batch_hash({"sample_ids": [2, 3]})}])
    step(model, opt, fp, 1)
    assert events.emitted == []
    if policy == "error":
        with pytest.raises(ResumeDiverged, match=r"step 2 after resuming.*\(loss\); part rng"):
            step(model, opt, fp, 2)
    else:
        step(model, opt, fp, 2)
    assert events.emitted[0][1]["step"] == 2 and events.emitted[0][1]["fields"] == ["loss"]


def test_diagnose_blames_inputs_before_outputs():
    assert diagnose(["batch", "loss", "state:model"])[0] == "data"
    assert diagnose(["lr", "state:optim", "state:model"])[0] == "sched"
    assert diagnose(["loss", "state:optim"])[0] == "rng"
    assert diagnose(["state:model", "state:optim", "state:trainer"])[0] == "optim"
    assert diagnose(["state:model", "state:mine"])[0] == "mine"


def test_truncate_after_returns_what_it_drops(tmp_path):
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    for s in (1, 2, 3):
        metrics.write({"step": s, "loss": float(s)})
    assert metrics.truncate_after(1) == [{"step": 2, "loss": 2.0}, {"step": 3, "loss": 3.0}]
    assert metrics.truncate_after(1) == []


def test_a_restore_hashes_the_restored_state_once_for_the_check_not_to_plan_the_load(tmp_path, monkeypatch):
    """Loading matches the fingerprints part against its `restore_template`: its state_dict would
    hash every other part (the whole state) only to be thrown away, before `watch` hashes it again."""
    model, opt, fp = make_log()
    step(model, opt, fp, 1)
    store = CheckpointStore(str(tmp_path))
    ref = store.save(1, {"model": model, "optim": opt, "fingerprints": fp})
    model2, opt2, again = make_log()
    calls = []
    monkeypatch.setattr(fingerprint, "state_digests", lambda *a, **k: calls.append(1) or state_digests(*a, **k))
    load(store, ref, {"model": model2, "optim": opt2, "fingerprints": again}, verify=Verify.WHILE)
    assert calls == [] and again.records == fp.records
    events = Events()
    again.watch(events, [])
    assert calls == [1] and events.emitted == []
