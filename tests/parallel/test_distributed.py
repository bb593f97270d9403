"""The process group's backend and device (harness/parallel/distributed.py), on a faked GPU host:
the device `train.device` resolves to decides, not whether a GPU is visible. The groups themselves
(gloo, real processes): tests/distributed/."""

from __future__ import annotations

import pytest
import torch

from harness.errors import UserError
from harness.parallel import distributed
from helpers import FakeGpus


@pytest.fixture
def joins(monkeypatch):
    """The backends and devices `process_group` joins with (rank 1 of 2, both on this node),
    recorded instead of joined; torch.cuda.set_device recorded too."""
    joined: list[tuple[str, dict]] = []
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: joined.append((backend, kw)))
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: joined[-1][0])
    monkeypatch.setattr(distributed.dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(distributed.process_end, "group_joined", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: joined.append(("set_device", {"index": index})))
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    return joined


def test_a_cpu_run_on_a_gpu_host_joins_gloo_and_claims_no_gpu(monkeypatch, joins):
    FakeGpus(monkeypatch, 1)
    with distributed.process_group("cpu"):
        pass
    assert joins == [("gloo", {})]


def test_cuda_joins_nccl_on_the_local_ranks_gpu(monkeypatch, joins):
    FakeGpus(monkeypatch, 2)
    for device in ("cuda", "auto"):
        with distributed.process_group(device):
            pass
    assert joins == [("set_device", {"index": 1}), ("nccl", {"device_id": torch.device("cuda", 1)})] * 2


def test_more_ranks_on_a_node_than_gpus_is_one_line_before_joining(monkeypatch, joins):
    """Two ranks, one GPU: NCCL needs a device per rank. Refused on every rank of the node (not a
    crash of the second at set_device), naming the counts and both ways out."""
    FakeGpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    needle = r"2 ranks on this node .* shows 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES=3\): start at most 1 per node .* 'cpu'"
    with pytest.raises(UserError, match=needle):
        with distributed.process_group("auto"):
            pass
    assert joins == []


def test_the_device_name_resolves_once_for_the_group_and_the_trainer(monkeypatch):
    assert distributed.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="train.device = 'cuda' but no CUDA device is visible"):
        distributed.resolve_device("cuda")
    FakeGpus(monkeypatch, 1)
    assert distributed.resolve_device("auto") == torch.device("cuda")
