"""Anomaly detection and the ledger, in-process: what is called a spike, what a ledger saves."""

import math

from harness.health.anomaly import Anomaly, AnomalyLedger, detect
from harness.run.state import TrainerCounters

SPIKES = {"spike_threshold": 6.0, "spike_window": 20}


def ledger_with(losses) -> AnomalyLedger:
    ledger = AnomalyLedger()
    for loss in losses:
        ledger.observe(loss, SPIKES["spike_window"])
    return ledger


def test_non_finite_loss_and_gradients_are_anomalies_spikes_only_when_enabled():
    ledger = ledger_with([2.0 + 0.01 * (i % 5) for i in range(20)])
    assert detect(ledger, 21, 21, math.nan, 1.0, grads_checked=True, spike_threshold=None,
                  spike_window=20).cause == "nonfinite_loss"
    assert detect(ledger, 21, 21, 2.0, math.inf, grads_checked=True, spike_threshold=None,
                  spike_window=20).cause == "nonfinite_grad"
    assert detect(ledger, 21, 21, 2.0, math.inf, grads_checked=False, spike_threshold=None, spike_window=20) is None
    assert detect(ledger, 21, 21, 9.0, 1.0, grads_checked=True, spike_threshold=None, spike_window=20) is None
    spike = detect(ledger, 21, 21, 9.0, 1.0, grads_checked=True, **SPIKES)
    assert spike.cause == "loss_spike" and 2.0 < spike.threshold < 2.2
    assert detect(ledger, 21, 21, 2.03, 1.0, grads_checked=True, **SPIKES) is None


def test_no_spike_is_called_before_half_the_window_and_one_spike_does_not_move_the_threshold():
    assert detect(ledger_with([2.0] * 9), 10, 10, 50.0, 1.0, grads_checked=True, **SPIKES) is None
    calm = ledger_with([2.0 + 0.01 * (i % 5) for i in range(19)])
    spiked = ledger_with([2.0 + 0.01 * (i % 5) for i in range(19)] + [40.0])
    assert abs(calm.spike_threshold(6.0, 20) - spiked.spike_threshold(6.0, 20)) < 0.05


def test_the_ledger_round_trips_and_an_empty_one_leaves_the_counters_state_as_it_was():
    counters = TrainerCounters()
    assert "anomalies" not in counters.state_dict()  # runs without anomalies save what they did before
    ledger = counters.anomalies
    entry = ledger.record_rollback(Anomaly(7, 7, "nonfinite_loss", math.nan), to_step=4, skip=[7])
    assert entry["value"] == "nan"
    assert ledger.record_rollback(Anomaly(7, 7, "nonfinite_loss", math.nan), 4, [7]) == entry
    assert len(ledger.history) == 1  # met again after a resume: one entry
    ledger.skipped = 1
    restored = TrainerCounters()
    restored.load_state_dict(counters.state_dict())
    assert restored.anomalies.state_dict() == ledger.state_dict()
    assert restored.anomalies.next_batch(7) == 9
