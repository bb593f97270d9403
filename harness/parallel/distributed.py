"""torchrun + DistributedDataParallel: the process group and the few collectives the harness needs.

`harness train` under `torchrun --nproc-per-node N --no-python harness train CONFIG` (or any
launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT) joins a process
group when WORLD_SIZE > 1, its backend chosen by the device the process trains on (`train.device`
resolved once, `resolve_device`), not by whether a GPU is visible: NCCL on CUDA with the device
LOCAL_RANK (a node with more ranks than visible GPUs is refused before any rank joins), gloo on the
CPU, a GPU host's included (`train.device = "cpu"` there hands NCCL no CPU tensor). Without one
(a plain `harness train`, or WORLD_SIZE=1) there is no process group, and every helper below is
the identity or a no-op, so a single-process run executes exactly the code it did before.

What the ranks agree on, and through which helper:
* `on_rank0(fn)`: decisions that read storage (the writer lease, which checkpoint to resume
  from) are taken once, on rank 0, and broadcast, so ranks never load different checkpoints.
  An exception there is raised on every rank, so all of them exit the same way instead of the
  others waiting in the next collective for a rank that is gone.
* `all_reduce_flag(flag)` (any rank): a preemption signal that reached one rank stops every rank
  at the same step boundary.
* `rank0_flag(flag)`: a checkpoint that rank 0's clock finds due (a minutes trigger, the "auto"
  cadence: both read a clock, which ranks do not share) is taken by every rank at that step.
* `all_gather_object` / `broadcast_object`: the commit of one checkpoint by all ranks
  (checkpoint/save/group_commit.py). These and `on_rank0` take a `group`: the background
  commit runs them on a second gloo group (`new_side_group`) from its persist thread, so they
  never interleave with the step loop's collectives on the main group.
The flags cost one all-reduce of one int each: cheap next to a training step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist

from harness.errors import Unavailable, UserError
from harness.log import get_logger
from harness.process import process_end
from harness.topology import Topology, topology_from_env

log = get_logger(__name__)

T = TypeVar("T")


def resolve_device(name: str) -> torch.device:
    """`train.device` (auto, cpu, cuda) as the device type this process trains on: auto is CUDA
    where a GPU is visible. The one place the name is resolved (the process group's backend and
    the trainer's device follow it)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device = 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
    return torch.device(name)


def claim_gpu(topo: Topology) -> torch.device:
    """This rank's GPU, its local rank's, made the current device; refused (one line) where the
    node has more ranks than visible GPUs: NCCL needs a device per rank."""
    visible = torch.cuda.device_count()
    if topo.local_world_size > visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UserError(f"{topo.local_world_size} ranks on this node train on CUDA but it shows {visible} GPU(s)"
                        f"{f' (CUDA_VISIBLE_DEVICES={shown})' if shown is not None else ''}: start at most "
                        f"{visible} per node (torchrun --nproc-per-node {visible}), or train on the CPU with "
                        "train.device = 'cpu'")
    torch.cuda.set_device(topo.local_rank)
    return torch.device("cuda", topo.local_rank)


@contextmanager
def process_group(train_device: str) -> Iterator[Topology]:
    """Join the process group for the duration of the block when WORLD_SIZE > 1, over the backend
    of `train_device` (`train.device`: auto, cpu or cuda; see the module docstring).

    On a normal exit the ranks meet at a barrier before the group is destroyed, so no rank
    tears down while another still needs it; on an error exit there is no barrier (the other
    ranks may be gone), the launcher ends the rest. A process that joined a group must end
    through `process_end.end` (the CLI's main does): gloo's threads outlive the group.
    """
    topo = topology_from_env()
    if topo.world_size <= 1:
        yield topo
        return
    if resolve_device(train_device).type == "cuda":
        dist.init_process_group("nccl", device_id=claim_gpu(topo))
    else:
        dist.init_process_group("gloo")
    process_end.group_joined()  # the process must now end through process_end.end (see there)
    log.info("joined the process group", rank=topo.rank, world_size=topo.world_size,
             backend=dist.get_backend())
    try:
        yield topo
        dist.barrier()
    finally:
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0)) if is_distributed() else 0


def _device(group: Any = None) -> torch.device:
    # NCCL collectives need their tensors on this rank's GPU.
    nccl = dist.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def new_side_group(timeout_s: float) -> Any:
    """A second process group over every rank, gloo (host memory, any backend for training), for
    collectives that run off the main thread (the background checkpoint commit) and so must
    never interleave with the training collectives of the default group. Collective: every rank
    calls it at the same point. None without a process group. Its collectives give up after
    `timeout_s` (a rank that died mid-commit must not hold the others forever)."""
    if not is_distributed():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def barrier(group: Any = None) -> None:
    if is_distributed():
        dist.barrier(group=group)


@overload
def broadcast_object(obj: None, src: int = 0, group: Any = None) -> Any: ...
@overload
def broadcast_object(obj: T, src: int = 0, group: Any = None) -> T: ...
def broadcast_object(obj: object, src: int = 0, group: Any = None) -> object:
    """`obj` of rank `src` on every rank of `group` (default: the main group; pickled: small
    objects only). A receiving rank passes None: what it gets is whatever `src` sent (typed Any)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_device(group), group=group)
    return box[0]


def all_gather_object(obj: T, group: Any = None) -> list[T]:
    """Every rank's `obj`, in rank order, on every rank (pickled: small objects only)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj, group=group)
    return out


def _reduce_int(value: int, op: dist.ReduceOp.RedOpType) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=op)
    return int(t.item())


def all_reduce_flag(flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank."""
    return _reduce_int(int(flag), dist.ReduceOp.MAX) == 1 if is_distributed() else flag


def all_ok(flag: bool) -> bool:
    """True on every rank when `flag` is true on every rank."""
    return _reduce_int(int(flag), dist.ReduceOp.MIN) == 1 if is_distributed() else flag


def rank0_flag(flag: bool) -> bool:
    """Rank 0's `flag` on every rank."""
    return _reduce_int(int(flag) if rank() == 0 else 0, dist.ReduceOp.MAX) == 1 if is_distributed() else flag


def on_rank0(fn: Callable[..., T], *args: Any, group: Any = None, **kwargs: Any) -> T:
    """Run `fn` on rank 0 only and return its (picklable, small) result on every rank; an
    exception it raises is raised on every rank (on rank 0 the original; elsewhere a UserError
    or Unavailable with the same message, so every rank exits with the same code, or a
    RuntimeError naming the original type)."""
    if not is_distributed():
        return fn(*args, **kwargs)
    if rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except Exception as e:
            broadcast_object((False, failure_of(e)), group=group)
            raise
        broadcast_object((True, result), group=group)
        return result
    ok, value = broadcast_object(None, group=group)
    if not ok:
        raise raised_elsewhere(value)
    return value


def failure_of(error: BaseException) -> tuple[str | None, str]:
    """What of rank 0's `error` travels to the other ranks (`raised_elsewhere` rebuilds it): its
    kind (UserError, Unavailable or neither) and its message; any exception can be sent that way."""
    kind = next((k for k in (Unavailable, UserError) if isinstance(error, k)), None)
    message = str(error) if kind else f"rank 0 failed: {type(error).__name__}: {error}"
    return kind and kind.__name__, message


def raised_elsewhere(failure: tuple[str | None, str]) -> Exception:
    """The exception a rank raises for rank 0's `failure_of(error)`: a UserError or Unavailable
    with the same message, so every rank exits with the same code, else a RuntimeError."""
    kind, message = failure
    kinds: dict[str | None, type[Exception]] = {"Unavailable": Unavailable, "UserError": UserError}
    return kinds.get(kind, RuntimeError)(message)


class Silent:
    """Rank 0's metrics and event logs as seen from the other ranks: takes every call, writes
    nothing (every rank computes the same all-reduced loss; one copy of each log is enough)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return _ignore


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


class SampleLog:
    """`debug.sample_log`: each rank appends the sample ids of every batch it trains on to
    `LOG_DIR/samples-rank-NNNNN.jsonl` (`{"step", "rank", "world", "epoch", "position", "ids"}`),
    so tests can check that no sample is repeated or skipped across ranks and world sizes."""

    def __init__(self, log_dir: str | Path) -> None:
        self.path = Path(log_dir) / f"samples-rank-{rank():05d}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, batch: Any) -> None:
        record = {"step": step, "rank": rank(), "world": world(), "epoch": batch.epoch, "position": batch.position,
                  "ids": [int(i) for i in batch.sample_ids]}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
