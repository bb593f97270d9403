"""Optimizers on parameters sharded by FSDP2 (DTensors; optim/sharded.py) equal the one-process
math, with their state created eagerly in the parameter's placement.

One group (world size 2, gloo, real processes: tests/distributed/launch.py `Ranks`) runs every arm of optim.build
(fsdp_worker.py): a model sharded by `fully_shard` (uneven shards, an empty shard, row and column
shards; and on a 2D HSDP mesh for muon and adafactor) against the same model unsharded in the same
process, on the same batches, for 3 steps, then a fresh bundle loads the name-keyed state and takes a 4th.

Bitwise: muon (also on HSDP), olion (also in several rounds), lion (ours), sgdm and adamw (torch's, on DTensors),
parameters and state.
Adafactor to float rounding: its column statistic, mean(r) and rms(u) are sums over the shards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from optim import Adafactor2D, Lion, Muon, OLion
from optim.dtensor import local
from optim.sharded import chunk_sizes, layout_of

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "distributed"))

from launch import Ranks, run, tail  # noqa: E402

MATRIX_ARMS = ("muon", "olion", "lion", "adafactor", "muon@hsdp", "adafactor@hsdp", "olion@rounds")
BITWISE_ARMS = ("muon", "olion", "lion", "sgdm", "adamw", "muon@hsdp", "olion@rounds")
ARMS_RUN = (*BITWISE_ARMS, "adafactor", "adafactor@hsdp")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sharded")
    log = out / "workers.log"
    assert run(Ranks((str(out),), script=str(HERE / "fsdp_worker.py")), log) == 0, tail(log)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def test_state_exists_before_the_first_step_in_the_parameters_placement(reports):
    for variant in MATRIX_ARMS:
        arm, report = variant.split("@")[0], reports[0][variant]
        matrices = sorted(n for n in report["params"] if n.startswith("blocks.") and n.endswith("weight")
                          and not n.endswith("ln.weight"))
        before = report["before"]
        keys = {"muon": ("mom",), "adafactor": ("r", "c")}.get(arm, ("m",))
        assert sorted(before) == sorted(f"{arm}/{n}/{k}" for n in matrices for k in keys), arm
        # torch.distributed.checkpoint sees the same entries (it found state, so it did not make its own).
        assert report["dcp_before"] == sorted(f"{n}/{k}" for n in matrices for k in keys), arm
        for n in matrices:
            placement = report["params"][n]
            if arm == "adafactor":
                # r is sharded where the rows are, c where the columns are; the other replicated.
                r = placement.replace("Shard(dim=1)", "Replicate()")
                c = placement.replace("Shard(dim=0)", "Replicate()").replace("Shard(dim=1)", "Shard(dim=0)")
                assert before[f"{arm}/{n}/r"][:2] == ["DTensor", r] and before[f"{arm}/{n}/c"][:2] == ["DTensor", c]
            else:
                assert before[f"{arm}/{n}/{keys[0]}"][:2] == ["DTensor", placement], (arm, n)
    # The models reached every path: row shards, column shards, a 2D (HSDP) mesh.
    assert {"(Shard(dim=0),)", "(Shard(dim=1),)"} <= set(reports[0]["muon"]["params"].values())
    assert "(Replicate(), Shard(dim=0))" in reports[0]["muon@hsdp"]["params"].values()
    # One round of all 8 matrices by default; with the budget cut, rounds of a multiple of the
    # world size (so the owners stay round-robin over the group), but the last.
    assert reports[0]["muon"]["rounds"] == [8]
    assert reports[0]["olion@rounds"]["rounds"] == [2, 2, 2, 2]


def test_placements_a_matrix_optimizer_cannot_step_are_refused_naming_the_parameter(reports):
    partial, two_dims = reports[0]["refused"]
    assert "Muon parameter 'blocks.0.w' of shape (4, 4) has placements (Partial(sum),)" in partial
    assert "(Shard(dim=0), Shard(dim=1))" in two_dims and "route it to AdamW or Lion" in two_dims


def test_every_rank_holds_the_same_state_keys_before_and_after_steps_and_a_load(reports):
    for arm in ARMS_RUN:
        for when in ("before", "after", "loaded"):
            assert reports[0][arm][when] == reports[1][arm][when], (arm, when)
        assert reports[0][arm]["after"] == reports[0][arm]["loaded"], arm
        assert reports[0][arm].get("dcp_before") == reports[1][arm].get("dcp_before"), arm


@pytest.mark.parametrize("arm", BITWISE_ARMS)
def test_sharded_steps_are_bitwise_the_one_process_steps(reports, arm):
    for report in reports:
        for what in ("param_diff", "state_diff"):
            differ = {n: d for n, (equal, d, _) in report[arm][what].items() if not equal}
            assert not differ, (arm, what, differ)
        assert report[arm]["state_diff"], arm  # compared something


@pytest.mark.parametrize("variant", ["adafactor", "adafactor@hsdp"])
def test_sharded_adafactor_equals_the_one_process_steps_to_float_rounding(reports, variant):
    """Relative to each tensor's largest entry. The sums' rounding (float32, ~1e-7) grows over the
    4 steps through the gradients; a statistic missing the other rank's rows or columns would be
    off by a large fraction of itself."""
    for report in reports:
        params = report[variant]["param_diff"]
        assert len(params) == 20 and max(d / scale for _, d, scale in params.values()) < 1e-5, params
        state = {n: v for n, v in report[variant]["state_diff"].items() if n.startswith("adafactor/")}
        assert len(state) == 16 and max(d / scale for _, d, scale in state.values()) < 1e-5, state


def test_chunk_sizes_cut_as_torch_chunk_and_dtensor_shard():
    for n in range(0, 12):
        for world in (1, 2, 3, 4):
            expected = [c.shape[0] for c in torch.arange(n).chunk(world)]
            assert list(chunk_sizes(n, world)) == expected + [0] * (world - len(expected)), (n, world)


def test_plain_tensors_have_no_layout_and_are_their_own_local_part():
    t = torch.zeros(3, 4)
    assert layout_of(t) is None and local(t) is t


@pytest.mark.parametrize("cls", [Muon, Lion, OLion, Adafactor2D])
def test_state_is_created_with_the_optimizer_and_again_after_a_load_that_lacks_it(cls):
    """Eager state (optim/base.py) on plain tensors too: the same zeros the first step used to make."""
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = cls([p])
    shapes = opt.state_shapes(p)
    assert {k: tuple(v.shape) for k, v in opt.state[p].items()} == shapes
    assert all(not v.any() for v in opt.state[p].values())
    opt.load_state_dict({"state": {}, "param_groups": opt.state_dict()["param_groups"]})
    assert {k: tuple(v.shape) for k, v in opt.state[p].items()} == shapes
