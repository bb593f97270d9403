"""The distributed Muon step (optim.sharded: each matrix orthogonalised once, on its owner rank)
against gather-everything (every rank gathers every whole update with `full_tensor()` and
orthogonalises all of them), on the block matrices of a GPT sharded by FSDP2's `fully_shard`.

Run under torchrun; every rank builds the same model and gradients:

    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        ops/bench/sharded_muon.py                                  # d=256, 4 blocks, CPU, gloo

Both contenders are the same `optim.muon.Muon` over the same sharded parameters; the baseline
swaps its orthogonalisation for `gather_everything` (below). They are stepped alternately, with a
barrier before each step; a step's wall time is the slowest rank's. CPU time is this rank's main
thread (the collectives' waiting is not in it; gloo moves bytes on its own threads), so it shows
the Newton-Schulz work each rank does. Bytes are the payload each rank receives per step
(counted at the all-to-all calls for ours; the other ranks' pieces of every matrix for the
baseline). The first step of each is compared: the parameters must be bitwise equal.
Prints a markdown table (record it in docs/bench-optim.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import optim.muon
import optim.sharded
from harness.process import process_end
from optim.newton_schulz import ns_batches, orthogonalize
from optim.sharded import layout_of

sys.path.insert(0, str(Path(__file__).parent))
from optim_step import GPTShapes  # noqa: E402

RECEIVED = {"bytes": 0}


def gather_everything(params, updates, steps, dtype, batched=None):
    """The naive distributed Muon: every rank gathers every whole update and orthogonalises all
    of them, then keeps its own piece of each result."""
    wholes = []
    for p, u in zip(params, updates, strict=True):
        w = DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        RECEIVED["bytes"] += (w.numel() - u.numel()) * w.element_size()
        wholes.append(w)
    result = {}
    for batch in ns_batches(wholes, batched, dtype):
        for m, q in zip(batch, orthogonalize(batch, steps, dtype), strict=True):
            result[id(m)] = q
    out = []
    for p, w in zip(params, wholes, strict=True):
        layout = layout_of(p)
        out.append(result[id(w)].narrow(layout.dim, layout.offset(layout.rank), layout.sizes[layout.rank]))
    return out


def counting_all_to_all(stock):
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        me = dist.get_rank(group)
        RECEIVED["bytes"] += (output.numel() - output_split_sizes[me]) * output.element_size()
        return stock(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
    return all_to_all_single


@contextmanager
def orthogonalization(fn):
    stock = optim.muon.orthogonalize_matrices
    optim.muon.orthogonalize_matrices = fn
    try:
        yield
    finally:
        optim.muon.orthogonalize_matrices = stock


def sharded_muon(args, device):
    """Muon over the block matrices of a fully_shard-ed GPT, each with a fixed gradient."""
    torch.manual_seed(0)
    model = GPTShapes(args.dim, args.blocks, args.vocab, args.ctx).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    gen = torch.Generator().manual_seed(1)
    for p in matrices:
        p.grad = distribute_tensor(torch.randn(p.shape, generator=gen).to(device), p.device_mesh, p.placements)
    return matrices, optim.muon.Muon(matrices, ns_dtype=args.ns_dtype)


def timed(step, device) -> tuple[float, float, int]:
    """(slowest rank's wall seconds, this rank's CPU seconds, bytes received) of one step."""
    dist.barrier()
    RECEIVED["bytes"] = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.thread_time()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    slowest = torch.tensor([wall])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item(), cpu, RECEIVED["bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=256, help="model width d (not --d: torchrun would take it)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=64, help="(the embeddings are not stepped)")
    parser.add_argument("--ctx", type=int, default=16)
    parser.add_argument("--ns-dtype", default="auto")
    parser.add_argument("--reps", type=int, default=10, help="timed steps per contender")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and dist.is_nccl_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    process_end.group_joined()  # the group's threads outlive it: end without finalizing (below)
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    optim.sharded.dist.all_to_all_single = counting_all_to_all(dist.all_to_all_single)

    ours_params, ours = sharded_muon(args, device)
    base_params, base = sharded_muon(args, device)

    def baseline():
        with orthogonalization(gather_everything):
            base.step()

    contenders = {"ours (owner per matrix)": ours.step, "gather everything": baseline}
    first = {name: timed(step, device) for name, step in contenders.items()}
    equal = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ours_params, base_params, strict=True))
    times = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.reps):
        for name in names[r % 2:] + names[:r % 2]:
            times[name].append(timed(contenders[name], device))
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        total = sum(p.numel() * p.element_size() for p in ours_params)
        print(f"world={world} backend={dist.get_backend()} d={args.dim} blocks={args.blocks} "
              f"matrices={len(ours_params)} ({total / 2**20:.1f} MiB of updates) ns_dtype={args.ns_dtype} "
              f"torch={torch.__version__}\nfirst step bitwise equal: {equal}\n")
        print("| contender | wall ms/step (slowest rank) | rank-0 CPU ms/step | MiB received per rank/step |"
              "\n|---|---:|---:|---:|")
        for name, rows in times.items():
            wall, cpu = statistics.median(w for w, _, _ in rows), statistics.median(c for _, c, _ in rows)
            print(f"| {name} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {first[name][2] / 2**20:.2f} |")
        ours_name, base_name = names
        wall_ratio = statistics.median(a[0] / b[0] for a, b in zip(times[ours_name], times[base_name], strict=True))
        cpu_ratio = statistics.median(a[1] / b[1] for a, b in zip(times[ours_name], times[base_name], strict=True))
        print(f"\nours / gather-everything: wall {wall_ratio:.3f}, CPU {cpu_ratio:.3f}, bytes "
              f"{first[ours_name][2] / first[base_name][2]:.3f} (expected 2/world = {2 / world:.3f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    process_end.end(0)  # a process that joined a group ends this way (harness/process/process_end.py)
