"""The in-process checks of ops/gpu_check.py: what a GPU does to a save, a hash, a finite check and a
load, counted and timed in this process (docs/gpu.md lists what each would catch).

* `async_save`: ~1 GiB of device state saved in the background through a staging ring smaller than
  it (not a power of two), updated in place right after `save` returns; its files against a
  synchronous save's, the host memory it pinned against the ring (torch's caching host allocator
  must not grow; RSS grows by the ring), then a ring grown from half the state to the whole one
  (the old block given back: RSS grows by the larger ring only).
* `blocking_events`: a host thread waiting for a copy's event (`copies_done`) against a GPU busy
  for half a second: its CPU time, against torch's default event's.
* `hash_and_finite`: the fingerprints' state hash and the finite-state check of a real trainer's
  state under torch.profiler: device-to-host copies and host syncs counted, thresholds asserted;
  the digests against those of a CPU copy.
* `resume_read`: the saved checkpoint loaded into the live device tensors under the profiler: no
  host-to-device copy from pageable memory, few syncs, the state hashing as saved.

Each takes the device (`cpu` runs the same code on the host, for the CPU smoke test: the copy counts
are then zero) and returns a `Result`. Importable and runnable without a GPU.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from harness.checkpoint import CheckpointStore, load
from harness.checkpoint.device_reads import PIECE_BYTES
from harness.checkpoint.host_memory import copies_done
from harness.checkpoint.save.async_saver import AsyncSaver
from harness.checkpoint.save.commit import Committer
from harness.config import load_config
from harness.repro.fingerprint import state_digests
from harness.run.trainer import Trainer

MIB = 1 << 20
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


@dataclass
class Result:
    """One check's line (`status`: PASS, FAIL or SKIP) and its figures."""

    name: str
    status: str
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


def verdict(name: str, problems: list[str], figures: dict[str, Any], passed: str) -> Result:
    return Result(name, "FAIL" if problems else "PASS", "; ".join(problems) or passed, figures)


class Buffers(torch.nn.Module):
    """A state of `count` buffers of `mib` MiB each (float32, seeded) plus a few small ones, on `device`."""

    def __init__(self, count: int, mib: int, device: torch.device) -> None:
        super().__init__()
        g = torch.Generator(device=device).manual_seed(0)
        for i in range(count):
            self.register_buffer(f"w{i}", torch.randn(mib * MIB // 4, generator=g, device=device))
        self.register_buffer("step", torch.tensor(7, device=device))
        self.register_buffer("bias", torch.randn(1000, generator=g, device=device).half())


def file_hashes(store: CheckpointStore, step: int) -> dict[str, tuple[int, str]]:
    return {r.name: (r.size, r.digest) for r in store.manifest(store.ref(step)).files}


def host_pinned_bytes(device: torch.device) -> int:
    """The bytes torch's caching host allocator holds (rounded up to powers of two); 0 on a CPU."""
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)) if device.type == "cuda" else 0


def rss() -> int:
    return int(psutil.Process().memory_info().rss)


def async_save(device: torch.device, work: Path, state_mib: int, staging_mib: int) -> tuple[Result, dict[str, Any]]:
    """See the module docstring. Leaves `work/sync` (a checkpoint of the state at step 1) for
    `resume_read`, and returns the state's digests with the result."""
    count = max(2, state_mib // 128)
    state = Buffers(count, state_mib // count, device)
    before = state_digests({"model": state})
    t0 = time.perf_counter()
    sync = CheckpointStore(str(work / "sync"))
    sync.save(1, {"model": state})
    sync_s = time.perf_counter() - t0
    store = CheckpointStore(str(work / "async"))
    saver = AsyncSaver(Committer(store), staging_bytes=staging_mib * MIB)
    pinned0, rss0 = host_pinned_bytes(device), rss()
    submitted = saver.save(1, {"model": state})
    assert submitted is not None  # a first save is never skipped
    with torch.no_grad():
        for b in state.buffers():
            b.add_(1)  # the next step's in-place update, queued right after the snapshot
    saver.finish()
    persist_s = time.perf_counter() - t0 - sync_s
    ring = saver.ring
    figures = {"state_mib": round(submitted.nbytes / MIB), "staging_mib": staging_mib, "ring_mib": ring.nbytes / MIB,
               "ring_pinned": ring.pinned, "sync_save_s": round(sync_s, 2),
               "async_blocking_s": round(submitted.blocking_s, 3), "async_total_s": round(persist_s, 2),
               "host_allocator_growth_mib": (host_pinned_bytes(device) - pinned0) / MIB,
               "rss_growth_mib": round((rss() - rss0) / MIB)}
    problems = []
    if file_hashes(store, 1) != file_hashes(sync, 1):
        problems.append("the background save's files differ from the synchronous save's (the update leaked in?)")
    if ring.nbytes != staging_mib * MIB or ring.pinned != (device.type == "cuda"):
        problems.append(f"ring {ring.nbytes / MIB:g} MiB pinned={ring.pinned}, asked {staging_mib} MiB")
    if figures["host_allocator_growth_mib"] > 1:
        problems.append(f"torch's caching host allocator grew {figures['host_allocator_growth_mib']:g} MiB")
    if figures["rss_growth_mib"] > staging_mib + 128:
        problems.append(f"RSS grew {figures['rss_growth_mib']} MiB for a {staging_mib} MiB ring")
    problems += grown_ring(device, work, state_mib, figures)
    return verdict("async_save", problems, figures, f"files equal, {staging_mib} MiB ring pinned exactly, "
                   "a grown ring gave its old block back"), before


def grown_ring(device: torch.device, work: Path, state_mib: int, figures: dict[str, Any]) -> list[str]:
    """An unset ring made for half the state, then grown to the whole: RSS grows by the larger ring
    (a kept old block, or one rounded up to a power of two, adds more)."""
    half = Buffers(2, state_mib // 4, device)
    saver = AsyncSaver(Committer(CheckpointStore(str(work / "grown"), keep_last=2)))
    rss0 = rss()
    saver.save(1, {"model": half})
    saver.finish()
    whole = Buffers(4, state_mib // 4, device)
    saver.save(2, {"model": whole})
    saver.finish()
    growth = (rss() - rss0) / MIB - (state_mib if device.type == "cpu" else 0)  # a host state is RSS too
    figures["grown_ring_mib"] = saver.ring.nbytes / MIB
    figures["grown_rss_growth_mib"] = round(growth)
    if growth > state_mib + 128:
        return [f"a ring grown to {saver.ring.nbytes / MIB:g} MiB added {growth:.0f} MiB"]
    return []


def _busy_gpu(device: torch.device, seconds: float) -> None:
    """Queue about `seconds` of matrix products on the current stream."""
    x = torch.randn(4096, 4096, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y = x @ x
    end.record()
    end.synchronize()
    each = max(start.elapsed_time(end) / 1000, 1e-4)
    for _ in range(math.ceil(seconds / each)):
        y = y @ x
        y /= y.norm()


def _waiting_cpu(event: Any) -> tuple[float, float]:
    """(wall, CPU) seconds a thread spends in `event.synchronize()`."""
    spent: list[tuple[float, float]] = []

    def wait() -> None:
        t0, c0 = time.monotonic(), time.thread_time()
        event.synchronize()
        spent.append((time.monotonic() - t0, time.thread_time() - c0))

    thread = threading.Thread(target=wait)
    thread.start()
    thread.join()
    return spent[0]


def blocking_events(device: torch.device) -> Result:
    if device.type != "cuda":
        return Result("blocking_events", "SKIP", "needs a GPU: a CUDA event's wait")
    stream = torch.cuda.current_stream(device)
    figures = {}
    for label, make in (("copies_done", lambda: copies_done(stream)), ("default_event", _default_event(stream))):
        _busy_gpu(device, 0.5)
        wall, cpu = _waiting_cpu(make())
        figures[f"{label}_wait_s"], figures[f"{label}_cpu_s"] = round(wall, 3), round(cpu, 3)
    problems = []
    if figures["copies_done_wait_s"] < 0.2:
        problems.append(f"the GPU was not busy long enough to tell ({figures['copies_done_wait_s']} s)")
    if figures["copies_done_cpu_s"] > 0.2 * figures["copies_done_wait_s"]:
        problems.append(f"the writer's wait spun: {figures['copies_done_cpu_s']} s of CPU in "
                        f"{figures['copies_done_wait_s']} s")
    return verdict("blocking_events", problems, figures, "a waiting writer sleeps")


def _default_event(stream: Any) -> Callable[[], Any]:
    def make() -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event
    return make


def profiled(fn: Callable[[], Any], device: torch.device) -> tuple[Any, dict[str, int]]:
    """`fn()` under torch.profiler: its result and the copies and host syncs counted."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = [e.name for e in prof.events()]
    return result, {"d2h": sum("Memcpy DtoH" in n for n in names), "h2d": sum("Memcpy HtoD" in n for n in names),
                    "h2d_pageable": sum("Memcpy HtoD (Pageable" in n for n in names),
                    "syncs": max(0, sum(n in SYNC_CALLS for n in names) - (device.type == "cuda"))}  # less our own


MODEL_ARGS = "{ n_layer = 4, n_head = 8, d_model = 512, dropout = 0.1 }"


def hash_and_finite(device: torch.device, tiny: Path, work: Path, model_args: str = MODEL_ARGS) -> Result:
    """A real trainer's state (a GPT of `model_args`, by default 4 layers of width 512, with AdamW,
    whose `step` counters live on the host) after one step: the state hash copies one batch of at
    most 64 MiB at a time to the host (not a tensor at a time); the finite check moves no tensor
    and waits once."""
    cfg = load_config(tiny, [f"run_dir={str(work / 'trainer')!r}", f"train.device={device.type!r}",
                             f"model.args={model_args}"])
    trainer = Trainer(cfg)
    try:
        trainer.train_step()
        parts = {"model": trainer.model, "optim": trainer.optim}
        tensors = [t for t in (*trainer.model.parameters(), *trainer.model.buffers())]
        tensors += [v for opt in trainer.optim.optimizers.values() for st in opt.state.values()
                    for v in st.values() if isinstance(v, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type == device.type]
        nbytes = sum(t.numel() * t.element_size() for t in on_device)
        batches = math.ceil(nbytes / PIECE_BYTES)
        t0 = time.perf_counter()
        digests, hash_counts = profiled(lambda: state_digests(parts), device)
        hash_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, finite_counts = profiled(trainer.check_finite_state, device)
        finite_s = time.perf_counter() - t0
        host_copy = {"model": _host_copy(trainer.model)}
        same = state_digests(host_copy)["model"] == digests["model"]
    finally:
        trainer.close()
    cuda = device.type == "cuda"
    figures = {"tensors": len(tensors), "device_tensors": len(on_device), "state_mib": round(nbytes / MIB, 1),
               "batches": batches, "hash_s": round(hash_s, 3), "finite_s": round(finite_s, 3),
               **{f"hash_{k}": v for k, v in hash_counts.items()},
               **{f"finite_{k}": v for k, v in finite_counts.items()}}
    problems = [] if same else ["the state hash of the device state differs from that of its host copy"]
    if cuda and not 1 <= hash_counts["d2h"] <= batches + 2:
        problems.append(f"the hash made {hash_counts['d2h']} device-to-host copies for {batches} batches")
    if hash_counts["syncs"] > batches + 4:
        problems.append(f"the hash waited {hash_counts['syncs']} times for {batches} batches")
    if finite_counts["h2d"] > 1 or finite_counts["d2h"] > 2 or finite_counts["syncs"] > 2:
        problems.append(f"the finite check made {finite_counts['h2d']} host-to-device and {finite_counts['d2h']} "
                        f"device-to-host copies and {finite_counts['syncs']} syncs (at most 1, 2, 2)")
    return verdict("hash_and_finite", problems, figures,
                   f"hash: {hash_counts['d2h']} copies for {len(on_device)} tensors; finite check: one sync")


def _host_copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).cpu()


def resume_read(device: torch.device, work: Path, state_mib: int, digests: dict[str, Any]) -> Result:
    """`async_save`'s synchronous checkpoint loaded into a live device state of its shape."""
    count = max(2, state_mib // 128)
    live = Buffers(count, state_mib // count, device)
    with torch.no_grad():
        for b in live.buffers():
            b.zero_()
    store = CheckpointStore(str(work / "sync"))
    t0 = time.perf_counter()
    _, counts = profiled(lambda: load(store, store.ref(1), {"model": live}), device)
    load_s = time.perf_counter() - t0
    nbytes = sum(b.numel() * b.element_size() for b in live.buffers())
    figures = {"load_s": round(load_s, 2), "load_gib_s": round(nbytes / (1 << 30) / load_s, 2), **counts}
    problems = [] if state_digests({"model": live}) == digests else ["the loaded state differs from the saved one"]
    if device.type == "cuda" and not counts["h2d"]:
        problems.append("the profiler saw no host-to-device copy (it records no device activity here?)")
    if counts["h2d_pageable"] > 2:
        problems.append(f"{counts['h2d_pageable']} host-to-device copies from pageable memory (a tensor read whole?)")
    if counts["syncs"] > count + 8:
        problems.append(f"the load waited {counts['syncs']} times")
    return verdict("resume_read", problems, figures, f"{nbytes / (1 << 30):.2f} GiB loaded as saved")
