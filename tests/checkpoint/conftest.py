"""Shared pieces for checkpoint tests: a tiny model with awkward buffers, a trained state, and the
damage a verification must find."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog
import torch
from torch import nn

from harness.checkpoint import CheckpointRef
from harness.storage.digest import hexdigest
from helpers import flip_byte


class Tiny(nn.Module):
    """Two "blocks" matrices (for the matrix optimizers), a head, and bf16 / int / 0-d buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=True)])
        self.head = nn.Linear(6, 3)
        self.register_buffer("bf16", torch.zeros(4, dtype=torch.bfloat16))
        self.register_buffer("counts", torch.zeros(2, 3, dtype=torch.int64))
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x) * self.scale


class Bag:
    """A user part: any tree with a state_dict/load_state_dict pair."""

    def __init__(self, tree: dict | None = None) -> None:
        self.tree = tree or {}

    def state_dict(self) -> dict:
        return self.tree

    def load_state_dict(self, tree: dict) -> None:
        self.tree = tree


def train(model: nn.Module, opt, sched, steps: int = 3, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(5, 6, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        model.bf16.add_(torch.randn(4, generator=g).bfloat16())
        model.counts.add_(torch.arange(6).view(2, 3))
        model.scale.mul_(0.5)


def torch_state(seed: int = 0, steps: int = 3):
    """(model, AdamW, SGD, LambdaLR, user part) after `steps` steps; `steps=0` is a fresh start."""
    torch.manual_seed(seed)
    model = Tiny()
    params = list(model.parameters())
    adamw = torch.optim.AdamW(params[:2], lr=1e-2)
    sgd = torch.optim.SGD(params[2:], lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 0.5 ** s)

    class Both:
        def zero_grad(self):
            adamw.zero_grad()
            sgd.zero_grad()

        def step(self):
            adamw.step()
            sgd.step()

    if steps:
        train(model, Both(), sched, steps, seed)
    extra = Bag({"nan": float("nan"), "inf": -float("inf"), "tiny": 5e-324, "big": 2**70, "none": None,
                 "tuple": (1, "a"), "ints": {3: "three", 1: [True, False]}, "$odd": 1,
                 "t0": torch.tensor(7, dtype=torch.int32)})
    return {"model": model, "adamw": adamw, "sgd": sgd, "sched": sched, "extra": extra}


def flat(state) -> dict:
    """Every leaf of a state-dict tree by path (tensors as (dtype, shape, bytes) for bitwise equality)."""
    out = {}

    def walk(node, path):
        if isinstance(node, torch.Tensor):
            t = node.detach().contiguous().reshape(-1)
            out[path] = (node.dtype, tuple(node.shape), bytes(t.view(torch.uint8).numpy()))
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + (k,))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, path + (i,))
        else:
            out[path] = repr(node)

    walk(state, ())
    return out


def state_of(parts) -> dict:
    return {name: flat(part.state_dict()) for name, part in parts.items()}


def folder(ref: CheckpointRef) -> Path:
    return Path(ref.path)


def damage(ref: CheckpointRef) -> None:
    """Damage the checkpoint `ref` so that its verification fails: one byte in the middle of its
    state.json changed, the size kept."""
    state = folder(ref) / "state.json"
    flip_byte(state, at=state.stat().st_size // 2, mask=0x20)


def rewrite_manifest(ref: CheckpointRef) -> None:
    """Make the manifest match whatever the files now hold (to reach the content checks)."""
    path = folder(ref) / "manifest.json"
    doc = json.loads(path.read_text())
    for f in doc["files"]:
        data = (folder(ref) / f["name"]).read_bytes()
        f["size"], f["blake3"] = len(data), hexdigest("blake3", data)
    path.write_text(json.dumps(doc))


@pytest.fixture
def run_dir(tmp_path: Path) -> str:
    return str(tmp_path / "run")


@pytest.fixture(autouse=True)
def _fresh_logging():
    """`harness.cli.main` binds structlog to the current (captured) stderr; unbind it after each test."""
    yield
    structlog.reset_defaults()
