"""Run under torchrun (world size 2, gloo) by test_sharded.py: every arm of optim.build on a small
GPT-shaped model sharded by FSDP2 (`fully_shard` per block and on the root), against the same model
unsharded in this process, on the same batches. Writes what it saw to OUT/rank-R.json; the test
asserts on it.

The shapes are chosen to reach every path: a 49-row matrix (uneven shards: 25 and 24 rows), a
1-row matrix (rank 1's shard is empty), and block 1 sharded along columns (`Shard(1)`) where its
column count is even. `muon@hsdp` and `adafactor@hsdp` run the same on a 2D mesh (replicate x
shard, HSDP's placements (Replicate(), Shard(d))); `olion@rounds` with Newton-Schulz rounds cut
small, so the matrices take several rounds. Every rank trains on the same batch, so FSDP's averaged gradient is the
one-process gradient bit for bit ((g + g) / 2 == g) and a difference in the parameters can only
come from the optimizer.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard

import optim.sharded
from harness.parallel import distributed
from harness.process import process_end
from optim.build import build_bundle
from optim.config import parse_optim_config
from optim.muon import Muon
from optim.sharded import matrix_rounds

VOCAB, D, HIDDEN, STEPS = 32, 16, 49, 3
ARMS = {"muon": {"muon_weight_decay": 0.1}, "olion": {"wd": 0.1}, "lion": {"wd": 0.1},
        "adafactor": {"wd": 0.1}, "sgdm": {}, "adamw": {}}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.attn = torch.nn.Linear(D, D, bias=False)
        self.fc = torch.nn.Linear(D, HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, D)
        self.gate = torch.nn.Linear(D, 1, bias=False)

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h) + self.proj(torch.nn.functional.gelu(self.fc(h))) * self.gate(h)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.ln_f = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def sharded_model(hsdp: bool) -> Model:
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = Model()
    fully_shard(model.blocks[0], mesh=mesh)
    fully_shard(model.blocks[1], mesh=mesh,
                shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % 2 == 0 else Shard(0))
    fully_shard(model, mesh=mesh)
    return model


def train_step(model, opt, sched, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, 9), generator=g)
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()


def layout(opt) -> dict:
    """Every state tensor of the bundle: its type, placements and global shape, by name/key."""
    out = {}
    for opt_name, sd in opt.state_dict().items():
        for name, entry in sd["state"].items():
            for key, t in entry.items():
                out[f"{opt_name}/{name}/{key}"] = [type(t).__name__, str(getattr(t, "placements", None)),
                                                   list(t.shape)]
    return out


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def differences(sharded: dict, reference: dict) -> dict:
    """name -> [bitwise equal, max abs difference, max abs reference value] of two dicts of tensors
    with the same keys (the sharded ones gathered)."""
    out = {}
    for name, t in sharded.items():
        a, b = whole(t).detach().double(), reference[name].detach().double()
        out[name] = [torch.equal(a, b), (a - b).abs().max().item(), b.abs().max().item()]
    return out


def flat_state(opt) -> dict:
    return {f"{o}/{n}/{k}": t for o, sd in opt.state_dict().items()
            for n, entry in sd["state"].items() for k, t in entry.items() if isinstance(t, torch.Tensor)}


@contextmanager
def round_budget(variant: str):
    """`@rounds`: Newton-Schulz rounds of a few hundred bytes, so the sharded matrices take
    several rounds (each a pair of all-to-alls) instead of one."""
    stock = optim.sharded.MAX_STACK_BYTES
    if variant.endswith("@rounds"):
        optim.sharded.MAX_STACK_BYTES = 256
    try:
        yield
    finally:
        optim.sharded.MAX_STACK_BYTES = stock


def run_arm(variant: str) -> dict:
    with round_budget(variant):
        return run_variant(variant)


def run_variant(variant: str) -> dict:
    arm = variant.split("@")[0]
    cfg = parse_optim_config({"type": arm, "lr": 1e-2, **ARMS[arm]})
    reference, model = Model(), sharded_model(hsdp=variant.endswith("@hsdp"))
    ref_opt, ref_sched = build_bundle(cfg, reference, STEPS + 1)
    opt, sched = build_bundle(cfg, model, STEPS + 1)
    report = {"before": layout(opt),
              "params": {n: str(p.placements) for n, p in model.named_parameters()},
              "rounds": [len(r) for r in matrix_rounds(opt.optimizers[arm].param_groups[0]["params"], None,
                                                       torch.float32)] if arm in ("muon", "olion") else []}
    if arm in ("muon", "olion", "lion", "adafactor"):
        # torch.distributed.checkpoint's view: it must find the state (and so not initialise it with
        # a zero-gradient step of its own, which would move Adafactor's statistics).
        dcp = get_optimizer_state_dict(model, opt.optimizers[arm])
        report["dcp_before"] = sorted(f"{n}/{k}" for n, entry in dcp["state"].items() for k in entry)
    for step in range(STEPS):
        train_step(reference, ref_opt, ref_sched, step)
        train_step(model, opt, sched, step)
    report["after"] = layout(opt)
    # Resume through the name-keyed bundle state: a fresh bundle loads it and takes one more step.
    resumed, resumed_sched = build_bundle(cfg, model, STEPS + 1)
    resumed.load_state_dict(opt.state_dict())
    resumed_sched.load_state_dict(sched.state_dict())
    report["loaded"] = layout(resumed)
    train_step(reference, ref_opt, ref_sched, STEPS)
    train_step(model, resumed, resumed_sched, STEPS)
    report["param_diff"] = differences(dict(model.named_parameters()), dict(reference.named_parameters()))
    report["state_diff"] = differences(flat_state(resumed), flat_state(ref_opt))
    return report


def refusals() -> list[str]:
    """What Muon says when built over placements it cannot step: a partial sum, two sharded mesh
    dimensions."""
    out = []
    for shape, placements in (((2,), [Partial()]), ((1, 2), [Shard(0), Shard(1)])):
        mesh = init_device_mesh("cpu", shape)
        w = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh, placements))
        try:
            Muon([("blocks.0.w", w)])
        except ValueError as e:
            out.append(str(e))
    return out


def main() -> None:
    out = Path(sys.argv[1])
    with distributed.process_group("cpu") as topo:  # joined as `harness train` joins, so it ends as that does
        torch.use_deterministic_algorithms(True)
        report = {variant: run_arm(variant) for variant in [*ARMS, "muon@hsdp", "adafactor@hsdp", "olion@rounds"]}
        report["refused"] = refusals()
        (out / f"rank-{topo.rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
    process_end.end(0)  # without finalization, as `harness` ends after a process group (harness/process/process_end.py)
