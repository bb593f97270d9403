"""Shared fixtures for the optimizer tests (pytest runs in importlib mode, so helpers are
fixtures, not imports): a tiny GPT-shaped model, a deterministic training
step, and the safetensors + JSON round trip the checkpoint format applies to state dicts."""

import json

import pytest
import safetensors.torch
import torch

VOCAB, D = 32, 16


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.attn = torch.nn.Linear(D, D, bias=False)
        self.fc = torch.nn.Linear(D, 4 * D)
        self.proj = torch.nn.Linear(4 * D, D)

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h) + self.proj(torch.nn.functional.gelu(self.fc(h)))


class TinyGPT(torch.nn.Module):
    """Names like a GPT: emb.*, blocks.N.*, ln_f.*, head.*; `reverse` registers the same
    parameters in another order (a checkpoint must not depend on it)."""

    def __init__(self, seed: int = 0, n_blocks: int = 2, reverse: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        parts = [("emb", lambda: torch.nn.Embedding(VOCAB, D)),
                 ("blocks", lambda: torch.nn.ModuleList(Block() for _ in range(n_blocks))),
                 ("ln_f", lambda: torch.nn.LayerNorm(D)),
                 ("head", lambda: torch.nn.Linear(D, VOCAB, bias=False))]
        for name, make in reversed(parts) if reverse else parts:
            setattr(self, name, make())

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def train_steps(model, opt, sched, start: int, n: int) -> None:
    """n optimizer steps on batches that depend only on the step index."""
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, VOCAB, (4, 8), generator=g)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()


def json_roundtrip(state):
    """`state` through the checkpoint format: tensors via safetensors bytes, the rest via JSON."""
    tensors = {}

    def split(node, path):
        if isinstance(node, torch.Tensor):
            tensors[path] = node.contiguous()
            return {"__tensor__": path}
        if isinstance(node, dict):
            return {k: split(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [split(v, f"{path}/{i}") for i, v in enumerate(node)]
        return node

    tree = json.loads(json.dumps(split(state, "")))
    loaded = safetensors.torch.load(safetensors.torch.save(tensors))

    def join(node):
        if isinstance(node, dict):
            if set(node) == {"__tensor__"}:
                return loaded[node["__tensor__"]]
            return {k: join(v) for k, v in node.items()}
        if isinstance(node, list):
            return [join(v) for v in node]
        return node

    return join(tree)


def assert_tree_equal(a, b, path=""):
    """Bitwise equality of two state trees (torch.equal on tensors, == elsewhere)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tree_equal(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def reference_newton_schulz(G, steps=5, eps=1e-7):
    """The team's reference Newton-Schulz, verbatim in its ops."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm() + eps)
    transposed = X.size(0) > X.size(1)
    if transposed:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.T if transposed else X


@pytest.fixture
def ref_ns():
    return reference_newton_schulz


@pytest.fixture
def tiny_gpt():
    return TinyGPT


@pytest.fixture
def train():
    return train_steps


@pytest.fixture
def roundtrip():
    return json_roundtrip


@pytest.fixture
def tree_equal():
    return assert_tree_equal
