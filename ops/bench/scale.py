"""Checkpoints at scale: saves and resumes of 0.5-4 GiB of state against the machine's own limits,
in one process, each figure a ratio to its baseline measured in the same run, in rounds that
alternate the two (this machine's disk and cores are shared: a baseline taken minutes away is not
a baseline), reported as the median of the per-round ratios with their range.

The state is `--sizes` GiB of float32 tensors of 16 MiB each (a 1024-wide model's MLP matrix), in
two parts ("model" and "optim", a quarter and three quarters, as a model with AdamW's two
moments), held as module buffers (what a trainer's parts are), with the trainer's `fingerprints`
part over them (the state hash a resume checks, which a background save's writer takes from the
staged copy: harness/checkpoint/later.py). The run dir is a temporary folder
on `--dir`'s file system. Per size:
* blocking: the seconds `AsyncSaver.save` holds the step loop (its staging ring prepared ahead, as
  the step loop's `prepare` leaves it) against a plain `torch` copy of the same tensors into
  preallocated, touched host memory (the limit); and per GiB;
* save throughput: a raw write + fsync of the same bytes (two files, through the page cache) over
  the background save's persist (serialize, hash, write, fsync, commit, retention): >= 1 is as fast
  as a plain write; and a raw `O_DIRECT` write + fsync of them (from page-aligned memory, 64 MiB a
  call: the disk's own speed, which the harness's writes around the page cache aim at) over it;
* the writer's CPU-seconds per GiB saved: the process's CPU time during the persist less the
  step-loop thread's (which waits), i.e. serialize + hash + write + fsync in this process (the
  kernel's writeback threads are not counted);
* step time during a background save: a real training step (the harness's GPT, forward, backward
  and AdamW, on `--step-threads` threads, 1 by default: a core left for the writer on this 2-core
  machine; Python-heavy, so a writer that held the GIL would show) timed while the save persists,
  against a block of the same steps with no save in the same round, with the writer placed as a
  trainer places it (`checkpoint.writer_cores = "auto"`: the core the training thread leaves, the
  disk's interrupts first) and with it on any core, both in each round; and the step-loop seconds a
  save's persist cost, summed over the steps beside it (each step's excess over the no-save median):
  a writer that is fast and a writer that slows the steps less over a longer persist compare there;
* RSS: the peak resident memory sampled every 5 ms during a save, minus the resident memory before
  its saver existed (the state alone), with the default ring (the state's size) and with
  `--cap-mib` (goal: the cap plus 64 MiB at most), and the capped save's blocking and persist;
* restore: `harness.checkpoint.load` with `Verify.WHILE` (what a resume does: every byte hashed as
  it streams into the live tensors) against a raw `readinto` of the checkpoint's own files into
  preallocated memory, warm (page cache) and cold (the files' pages dropped with posix_fadvise
  DONTNEED after a sync), and the peak RSS a load adds.
Every size also prints the load average and the share of the two cores that other processes
used during its run, so a figure taken beside other work says so.

With `--device cuda` (ops/gpu_check.sh runs it) the state lives on the GPU: the staging ring is
pinned, the device-to-host copies run on a side stream, and "blocking" is the time until the copy
is done on the device (`save` returns before it; the next step's kernels wait for it), against
`torch` copies of the same tensors into preallocated pinned memory; the raw write and the raw read
use host memory (the disk's limit), and the training step runs on the GPU.

    python ops/bench/scale.py --sizes 0.5,2,4 [--cap-mib 256] [--rounds 3] [--dir /tmp] [--device cuda]
                              [--arms saves,steps,restores]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.checkpoint import CheckpointStore, load  # noqa: E402
from harness.checkpoint.loading import Verify  # noqa: E402
from harness.checkpoint.save.async_saver import AsyncSaver  # noqa: E402
from harness.checkpoint.save.commit import Committer  # noqa: E402
from harness.checkpoint.save.writer_cores import place_writers  # noqa: E402
from harness.log import configure  # noqa: E402
from harness.models.gpt import GPT, GPTConfig  # noqa: E402
from harness.repro.fingerprint import FingerprintLog  # noqa: E402

TENSOR = 4 << 20  # float32 elements: 16 MiB tensors
GIB = 1 << 30


def state_of(gib: float, device: str = "cpu") -> dict[str, Any]:
    """`gib` GiB of random float32 buffers on `device`, a quarter in "model", the rest in "optim",
    and a "fingerprints" part over both (as a trainer registers it)."""
    count = max(4, round(gib * GIB / (TENSOR * 4)))
    modules = {"model": torch.nn.Module(), "optim": torch.nn.Module()}
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        part = modules["model"] if i < count // 4 else modules["optim"]
        part.register_buffer(f"t{i:05d}", torch.rand(TENSOR, generator=g).to(device))
    return {**modules, "fingerprints": FingerprintLog(lambda: modules, every=0)}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def modules_of(parts: dict[str, Any]) -> dict[str, torch.nn.Module]:
    """The parts that hold the state's tensors (not the fingerprints over them)."""
    return {name: part for name, part in parts.items() if isinstance(part, torch.nn.Module)}


def tensors_of(parts: dict[str, Any]) -> list[torch.Tensor]:
    return [t for part in modules_of(parts).values() for t in part.buffers()]


def rss() -> int:
    return psutil.Process().memory_info().rss


class PeakRss:
    """The peak RSS of this process while in the block, sampled every 5 ms (not `sampled`: none,
    so a timed step shares the GIL with no sampler)."""

    def __init__(self, sampled: bool = True) -> None:
        self.sampled = sampled

    def __enter__(self) -> PeakRss:
        self.peak, self.cpu, self._stop = rss(), 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        if self.sampled:
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())
        self.cpu = sum(cpu(resource.RUSAGE_THREAD))  # the sampler's own, for a caller that counts the process's

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.sampled:
            self._thread.join()


class Machine:
    """The load beside this process while in the block: the load average at its end and the share
    of every core that other processes used (busy time from /proc/stat less this process's CPU)."""

    @staticmethod
    def _busy() -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    def __enter__(self) -> Machine:
        self._t0, self._busy0, self._own0 = time.monotonic(), self._busy(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self._t0
        others = self._busy() - self._busy0 - (time.process_time() - self._own0)
        self.others_share = max(0.0, others) / (wall * (os.cpu_count() or 1))
        self.loadavg = os.getloadavg()[0]

    def __str__(self) -> str:
        return f"load average {self.loadavg:.1f}, other processes {self.others_share:.0%} of the cores"


def torch_copy_s(tensors: list[torch.Tensor], into: torch.Tensor) -> float:
    """A plain copy of every tensor into `into` (preallocated and touched; pinned for GPU tensors,
    copied asynchronously, then waited for): the limit of a blocking copy."""
    t0, at = time.perf_counter(), 0
    for t in tensors:
        into[at:at + t.numel()].copy_(t, non_blocking=t.is_cuda)
        at += t.numel()
    synchronize(tensors[0].device.type)
    return time.perf_counter() - t0


def host_parts(parts: dict[str, Any], host: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Each part's tensors as host memory: themselves on a CPU, else their copies in `host` (in the
    layout `torch_copy_s` fills it)."""
    out, at = {}, 0
    for name, part in modules_of(parts).items():
        out[name] = []
        for t in part.buffers():
            out[name].append(t if not t.is_cuda else host[at:at + t.numel()])
            at += t.numel()
    return out


def raw_write_s(parts: dict[str, list[torch.Tensor]], folder: Path) -> float:
    """The tensors' bytes (host memory) written to one file per part, each fsynced (after a sync:
    no earlier file's writeback in the timed one); the files are removed after."""
    folder.mkdir(parents=True, exist_ok=True)
    os.sync()
    t0 = time.perf_counter()
    for name, tensors in parts.items():
        with open(folder / f"{name}.raw", "wb", buffering=0) as f:
            for t in tensors:
                f.write(memoryview(t.view(torch.uint8).numpy()))
            os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    for path in folder.glob("*.raw"):
        path.unlink()
    return seconds


def raw_direct_write_s(parts: dict[str, list[torch.Tensor]], host: torch.Tensor, folder: Path) -> float:
    """The same bytes as `raw_write_s`, written from `host` (page-aligned, holding the tensors in
    the order of `parts`: `torch_copy_s` filled it) with `O_DIRECT`, 64 MiB a call, a file per
    part, each fsynced; the files are removed after."""
    folder.mkdir(parents=True, exist_ok=True)
    view, at = memoryview(host.view(torch.uint8).numpy()), 0
    os.sync()
    t0 = time.perf_counter()
    for name, tensors in parts.items():
        end = at + sum(t.numel() * t.element_size() for t in tensors)
        fd = os.open(folder / f"{name}.raw", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for block in range(at, end, 64 << 20):
            os.pwrite(fd, view[block:min(block + (64 << 20), end)], block - at)
        os.fsync(fd)
        os.close(fd)
        at = end
    seconds = time.perf_counter() - t0
    for path in folder.glob("*.raw"):
        path.unlink()
    return seconds


def page_aligned(numel: int, pin: bool) -> torch.Tensor:
    """An empty float32 tensor of `numel` whose memory starts on a page (O_DIRECT writes from it)."""
    spare = torch.empty(numel + 1024, dtype=torch.float32, pin_memory=pin)
    skip = (-spare.data_ptr() % 4096) // 4
    return spare[skip:skip + numel]


def drop_cache(files: list[Path]) -> None:
    os.sync()  # DONTNEED drops clean pages only
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def raw_read_s(files: list[Path], into: torch.Tensor) -> float:
    """Every file read whole, in order, with `readinto` (64 MiB at a time) into `into`."""
    view, at = memoryview(into.view(torch.uint8).numpy()), 0
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while got := f.readinto(view[at:at + (64 << 20)]):
                at += got
    return time.perf_counter() - t0


class TrainingStep:
    """One training step of the harness's GPT (4 layers, 256 wide: forward, backward, AdamW) on a
    fixed batch: Python-heavy, so a writer holding the GIL would slow it."""

    def __init__(self, device: str) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = GPT(GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256)).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x, self.y = (torch.randint(256, (16, 128), device=device) for _ in range(2))
        self()

    def __call__(self) -> float:
        t0 = time.perf_counter()
        _, loss = self.model(self.x, self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        synchronize(self.device)
        return time.perf_counter() - t0


def cpu(who: int = resource.RUSAGE_SELF) -> tuple[float, float]:
    """(user, system) CPU seconds of the process (threads that ended included), or of the calling
    thread with `resource.RUSAGE_THREAD`."""
    usage = resource.getrusage(who)
    return usage.ru_utime, usage.ru_stime


def other_threads_cpu() -> tuple[float, float]:
    """(user, system) CPU seconds of every thread of this process but the calling one, so far."""
    (user, system), (mine_user, mine_system) = cpu(), cpu(resource.RUSAGE_THREAD)
    return user - mine_user, system - mine_system


class Saves:
    """Background saves of `parts` into `store` through one saver, as a training process holds one:
    its staging ring (`cap`: `checkpoint.staging_mib`; None: the state's size) prepared once,
    before the first save, as the step loop does. `before`: the resident memory before the saver
    existed (the state alone). `close` frees the ring (the saver's own references form cycles,
    which only a collection frees: a second saver would otherwise add a second ring)."""

    def __init__(self, parts, store: CheckpointStore, cap: int | None) -> None:
        gc.collect()
        self.parts, self.before, self.committed = parts, rss(), []
        self.saver = AsyncSaver(Committer(store), staging_bytes=cap, on_commit=self.committed.append)
        self.saver.prepare(parts)
        self.ring = self.saver.ring.nbytes  # waits for the allocation
        self.device = tensors_of(parts)[0].device.type

    def save(self, step: int, while_busy: Callable[[], object] | None = None) -> dict:
        """One save: blocking and persist seconds, the writer's CPU seconds, the peak RSS over
        `before` (not sampled with `while_busy`), and what `while_busy()` returned each time it ran
        while the save persisted (a step's seconds)."""
        os.sync()  # no earlier file's writeback during this one
        during = []
        with PeakRss(sampled=while_busy is None) as peak:
            t0 = time.perf_counter()
            self.saver.save(step, self.parts)
            synchronize(self.device)  # a GPU's copies are done (the next step's kernels wait for them)
            blocking = time.perf_counter() - t0
            threads0 = other_threads_cpu()
            while while_busy is not None and self.saver.busy:
                during.append(while_busy())
            self.saver.finish()
            threads1 = other_threads_cpu()
        # The writer's threads (the persist, its hash), not this one nor the RSS sampler (mostly
        # user time: taken off the user side).
        user, system = (b - a for a, b in zip(threads0, threads1, strict=True))
        return {"blocking": blocking, "persist": self.committed[-1].persist_s, "writer_cpu": user + system - peak.cpu,
                "writer_user": user - peak.cpu, "writer_system": system, "rss": peak.peak - self.before,
                "ring": self.ring, "during": during}

    def close(self) -> None:
        del self.saver
        gc.collect()


def restore_s(store: CheckpointStore, parts, verify: Verify = Verify.WHILE) -> tuple[float, int]:
    """A load of the newest checkpoint into `parts` (verified as a resume's: `Verify.WHILE`): its
    seconds and the peak RSS it added."""
    before = rss()
    with PeakRss() as peak:
        t0 = time.perf_counter()
        load(store, store.list()[-1], parts, verify=verify)
        seconds = time.perf_counter() - t0
    return seconds, peak.peak - before


def spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def saves(parts, args: argparse.Namespace, root: Path, limit: torch.Tensor, gib: float) -> None:
    """Blocking against a torch copy, persist against a raw write + fsync, the writer's CPU, RSS."""
    tensors = tensors_of(parts)
    host = host_parts(parts, limit)
    whole = Saves(parts, CheckpointStore(str(root / "run"), keep_last=2), None)
    rows = []
    for r in range(args.rounds):
        copy = torch_copy_s(tensors, limit)
        raw_first = r % 2 == 0  # the disk drifts: alternate which goes first
        raws = (lambda: raw_write_s(host, root / "raw"), lambda: raw_direct_write_s(host, limit, root / "raw"))
        raw = [timed() for timed in raws] if raw_first else None
        saved = whole.save(r + 1)
        raw = raw or [timed() for timed in raws[::-1]][::-1]
        rows.append((copy, raw, saved))
        print(f"  round {r + 1}: blocking {saved['blocking']:.3f} s, torch copy {copy:.3f} s; persist "
              f"{saved['persist']:.2f} s, raw write+fsync {raw[0]:.2f} s, raw O_DIRECT write+fsync {raw[1]:.2f} s; "
              f"writer CPU {saved['writer_cpu']:.2f} s")
    blocking = statistics.median(s["blocking"] for _, _, s in rows)
    print(f"  blocking {blocking:.3f} s = {blocking / gib:.3f} s/GiB; vs torch copy "
          f"{spread([s['blocking'] / c for c, _, s in rows])} (goal <= 1.2x)")
    print(f"  save throughput (raw write+fsync / persist) {spread([w / s['persist'] for _, (w, _), s in rows])} "
          f"(goal >= 0.9x); vs raw O_DIRECT write+fsync {spread([d / s['persist'] for _, (_, d), s in rows])}; "
          f"persist {statistics.median(s['persist'] for _, _, s in rows):.2f} s")
    user, system = (statistics.median(s[k] for _, _, s in rows) / gib for k in ("writer_user", "writer_system"))
    print(f"  writer CPU {statistics.median(s['writer_cpu'] for _, _, s in rows) / gib:.2f} s/GiB (serialize + hash + "
          f"write + fsync, this process): user {user:.2f} (the hash, the copy into the write buffers, Python), "
          f"system {system:.2f} (the write and fsync calls; with buffered writes, the page cache's pages)")
    whole.close()
    added = max(s["rss"] for _, _, s in rows)
    capped_saves = Saves(parts, CheckpointStore(str(root / "capped"), keep_last=2), args.cap_mib << 20)
    capped = capped_saves.save(1)
    capped_saves.close()
    print(f"  RSS a save adds: default ring {added / 2**20:.0f} MiB (ring {rows[0][2]['ring'] / 2**20:.0f} MiB, "
          f"goal <= {rows[0][2]['ring'] / 2**20 + 64:.0f}); cap {args.cap_mib} MiB: {capped['rss'] / 2**20:.0f} MiB "
          f"(goal <= {args.cap_mib + 64}), its blocking {capped['blocking']:.2f} s, persist {capped['persist']:.2f} s")


def steps_during_saves(parts, args: argparse.Namespace, root: Path) -> None:
    """A training step while a save persists against the same step with no save, round by round:
    each round saves twice, once with the writer placed as a trainer places it
    (`checkpoint.writer_cores = "auto"`) and once with it on any core, in alternating order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.step_threads)
    step = TrainingStep(args.device)
    saves = Saves(parts, CheckpointStore(str(root / "steps"), keep_last=2), None)
    arms = {"auto": Arm(), "any": Arm()}
    placed = None
    for r in range(args.rounds):
        alone = [step() for _ in range(args.alone_steps)]
        for name in sorted(arms, reverse=r % 2 == 1):
            cores = place_writers(name, args.step_threads)
            placed = cores if name == "auto" else placed
            arms[name].add(alone, saves.save(2 * r + 1 + (name == "any"), while_busy=step)["during"])
    place_writers("any", args.step_threads)
    saves.close()
    torch.set_num_threads(threads)
    for name, arm in arms.items():
        where = "any core" if name == "any" else f"cores {sorted(placed)}" if placed else "any core (none free)"
        print(f"  step during a background save, writer on {where} (writer_cores = {name}): "
              f"{statistics.median(arm.during) * 1e3:.0f} ms vs {statistics.median(arm.alone) * 1e3:.0f} ms without = "
              f"{spread(arm.ratios)} (goal <= 1.05x; {args.step_threads} training thread(s), {len(arm.during)} steps "
              f"during {args.rounds} saves); the step loop lost {statistics.median(arm.lost):.2f} s per save "
              f"({min(arm.lost):.2f}-{max(arm.lost):.2f}) to the persist beside it")


class Arm:
    """One way of placing the writer: per round, the steps beside its save against the round's steps alone."""

    def __init__(self) -> None:
        self.ratios: list[float] = []
        self.lost: list[float] = []
        self.alone: list[float] = []
        self.during: list[float] = []

    def add(self, alone: list[float], during: list[float]) -> None:
        base = statistics.median(alone)
        self.ratios.append(statistics.median(during or [float("nan")]) / base)
        self.lost.append(sum(during) - len(during) * base)
        self.alone += alone
        self.during += during


def restores(parts, args: argparse.Namespace, root: Path, limit: torch.Tensor) -> None:
    """A verified load against a raw read of the same files, warm then cold, round by round; and an
    unverified load, to tell the hash's share."""
    store = CheckpointStore(str(root / "run"), keep_last=2)
    files = sorted(Path(store.list()[-1].path).glob("*"))
    for cold in (False, True):
        if not cold:
            raw_read_s(files, limit)  # the files in the page cache
        ratios, rows = [], []
        for r in range(args.rounds):
            timed = {}
            order = ("raw", "load", "unverified") if r % 2 == 0 else ("unverified", "load", "raw")  # the disk drifts
            for which in order:
                if cold:
                    drop_cache(files)
                timed[which] = (raw_read_s(files, limit) if which == "raw" else
                                restore_s(store, parts, Verify.WHILE if which == "load" else Verify.NO))
            raw, (seconds, added), (unverified, _) = timed["raw"], timed["load"], timed["unverified"]
            ratios.append(seconds / raw)
            rows.append((seconds, raw, added, unverified))
        print(f"  restore {'cold' if cold else 'warm'} {statistics.median(r[0] for r in rows):.2f} s vs raw read "
              f"{statistics.median(r[1] for r in rows):.2f} s = {spread(ratios)} (goal <= 1.2x); unverified "
              f"{statistics.median(r[3] for r in rows):.2f} s; RSS it adds {max(r[2] for r in rows) / 2**20:.0f} MiB")


def run_size(gib: float, args: argparse.Namespace, root: Path) -> None:
    parts = state_of(gib, args.device)
    size = sum(t.numel() * 4 for t in tensors_of(parts)) / GIB
    limit = page_aligned(round(size * GIB) // 4, pin=args.device == "cuda")
    limit.zero_()  # touched: the copy and the read measure no page faults
    print(f"{size:.2f} GiB of state on {args.device}, {len(tensors_of(parts))} tensors:")
    with Machine() as machine:
        if "saves" in args.arms or "restores" in args.arms:  # the restores read the saves' checkpoint
            saves(parts, args, root, limit, size)
        if "steps" in args.arms:
            steps_during_saves(parts, args, root)
        if "restores" in args.arms:
            restores(parts, args, root, limit)
    print(f"  ({machine})")
    del parts, limit
    gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.5,2,4", help="GiB of state, comma-separated")
    p.add_argument("--cap-mib", type=int, default=256, help="the capped save's checkpoint.staging_mib")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--step-threads", type=int, default=1)
    p.add_argument("--alone-steps", type=int, default=8, help="steps per round timed with no save")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the state and the step live")
    p.add_argument("--arms", default="saves,steps,restores", help="which of saves, steps, restores to run")
    args = p.parse_args()
    configure("warning")
    print(f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / GIB:.0f} GiB; run dirs under {args.dir}; "
          f"{args.rounds} rounds")
    for gib in (float(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            run_size(gib, args, Path(tmp))


if __name__ == "__main__":
    main()
