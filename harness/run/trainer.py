"""One training step: forward/backward with gradient accumulation, clipping, AMP, the optimizer
and scheduler steps, the divergence checks, and evaluation.

Contract: the trainer owns the numbers, not the I/O and not the schedule of the run. It is built
from a `RunConfig`, exposes its resumable parts as a `TrainState` and returns each step's
numbers as a `StepResult`; the caller (harness/run/loop.py) logs them and decides when to save
(harness/run/cadence.py). Everything that decides the numbers of step N is a pure function of
the config and the restored state: nothing else draws random numbers or touches the data stream.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from harness.config import RunConfig, batch_shape
from harness.data import BatchStream, eval_batches
from harness.data.batch import split_batch, to_device
from harness.data.factory import is_iterator_source
from harness.data.iterator_stream import IteratorStream
from harness.data.sources import TrainData
from harness.errors import UserError
from harness.health import debug_hooks
from harness.health.anomaly import Anomaly, detect
from harness.log import get_logger
from harness.models.init_from import load_initial_weights
from harness.parallel import distributed, exact, exact_fsdp
from harness.parallel.sharding import full_value, holds_dtensors, materialize_optimizer_state, reshard, shard_model
from harness.repro import numerics
from harness.repro.buffer_probe import BufferProbe, non_persistent_buffers, updated_buffers
from harness.repro.completeness import check_buffers, check_registered
from harness.repro.fingerprint import FingerprintLog
from harness.repro.finite import first_nonfinite
from harness.repro.rng import RNGState, micro_batch_streams, seed_everything
from harness.repro.splitmix import derive_seed
from harness.run.device import compile_options, process_device
from harness.run.exact_mode import decide, with_buffers, with_mode
from harness.run.state import TrainerCounters, TrainState
from harness.task import BoundTask, StepInfo, load_task, task_context
from optim.build import build_bundle
from optim.bundle import MultiOpt
from optim.dtensor import local
from optim.errors import OptimError

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

log = get_logger(__name__)


class TrainingDiverged(UserError):
    """The loss, the gradient norm or the state became NaN/inf (or the loss spiked); no checkpoint
    of the poisoned state is written. `anomaly`: what a rollback can step over (a loss or gradient
    anomaly before the optimizer step), None for a poisoned state."""

    def __init__(self, message: str, anomaly: Anomaly | None = None) -> None:
        super().__init__(message)
        self.anomaly = anomaly


DIVERGED_ADVICE = "Lower the learning rate, enable train.grad_clip, or resume from the last checkpoint"


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: dict[str, list[float]]
    tokens: int
    seconds: float
    optim_seconds: float  # unscale, clip, optimizer and scheduler step, zero_grad (part of `seconds`)
    data_seconds: float = 0.0  # waiting for the next batch from the data stream (part of `seconds`)
    fingerprint: dict[str, Any] | None = None  # harness.repro.fingerprint record of this step


class StepModule(torch.nn.Module):
    """One micro-batch of the task as a module: the models are its submodule and its forward is the
    task's loss (or step), so what wraps a step wraps the whole of it: DDP's reducer sees every
    forward whatever models the loss calls, and `train.compile` compiles the loss too. Returns
    (the loss, the optimizers it steps: None for all)."""

    def __init__(self, task: BoundTask, models: torch.nn.Module, optim: MultiOpt) -> None:
        super().__init__()
        self.models = models
        self.task = task
        self.optim = optim

    def forward(self, batch: Any, info: StepInfo) -> tuple[torch.Tensor, tuple[str, ...] | None]:
        return self.task.micro_batch(self.models, self.optim, batch, info)


class Trainer:
    """Builds the task's models, optimizer bundle, data stream, RNG and scaler; runs steps."""

    def __init__(self, cfg: RunConfig, *, rank: int = 0, world_size: int = 1, task: BoundTask | None = None,
                 data: TrainData | None = None, fresh: bool = False, saved_exact: bool | None = None) -> None:
        """`task`: the run's task (default: `task.factory`'s, or the built-in language model);
        `data`: its data, when the caller opened them already (with the same `task`). `fresh`: a
        start at step 0, whose model then loads `model.init_from` (when set; `initialised_from`
        records what was read); a trainer a checkpoint is restored into never reads it.
        `saved_exact`: the mode of the checkpoint to be restored (None: a fresh start); the trainer
        decides its own (exact_mode.py: `exact`, `exact_why`, `cfg`), buffers judged once built.

        The order of the steps is part of the numbers: the run seed before the models draw their
        initial weights (the same on every rank), whole weights loaded before sharding, the
        sharded parameters before the optimizers take them, and the rank's own seed only once
        the models and the optimizers are built."""
        if data is not None and task is None:
            raise ValueError("Trainer: data opened by a task needs that task")
        self.rank = rank
        self.world_size = world_size
        self.task = task if task is not None else load_task(cfg)
        self.device = process_device(cfg, world_size)
        self.context = task_context(cfg, rank, world_size, self.device)
        self.data = data if data is not None else self.task.data(self.context)
        setting = cfg.parallel.exact_elastic
        self.exact, self.exact_why = decide(cfg, world_size, self.device.type, is_iterator_source(self.data.train),
                                            saved=saved_exact)
        self.cfg = with_mode(cfg, self.exact)
        self.batch_size, self.grad_accum = batch_shape(self.cfg, world_size)
        self._apply_numerics()
        seed_everything(self.cfg.train.seed)
        self.model = self.task.models(self.context).to(self.device)
        self.hf_config = self._hf_config()
        self.initialised_from = self._load_initial_weights(fresh)
        self.sharded = self._shard()
        self.optim, self.sched = self._build_optimizer()
        self._autocast, self.scaler = self._mixed_precision()
        self.counters = TrainerCounters()
        step = StepModule(self.task, self.model, self.optim)
        self._decide_on_buffers(step, setting)
        self.net = self._wrap_ddp(step)
        self._fsdp_gradients = exact_fsdp.FSDPGradients(self.model) if self.exact and self.sharded else None
        self._seed_rank()
        self.net = self._compile(self.net)
        self.batch_hook: Callable[[int, Any], None] | None = None  # debug.sample_log
        self.stream = self._open_stream()
        self.state = TrainState()
        self.fingerprints = FingerprintLog(
            lambda: {k: v for k, v in self.state.parts().items() if k != "fingerprints"},
            self.cfg.train.fingerprint_every, self.cfg.train.on_divergence)
        self._bundles: dict[tuple[str, ...], MultiOpt] = {}  # `_stepping`'s
        self._register_state()
        check_registered({"trainer": self}, self.state.parts(), self.cfg.train.unregistered_state)
        # Non-persistent buffers are judged by watching this process's first forward.
        self._buffer_probe = BufferProbe(self.model) if non_persistent_buffers(self.model) else None

    def _apply_numerics(self) -> None:
        """The process's reproducibility settings (harness/repro/numerics.py), before the model is
        built; refuses exact elastic mode on a CPU without a fixed thread count."""
        if self.exact and self.device.type == "cpu" and self.cfg.train.cpu_threads is None:
            # torch's own CPU kernels split their sums by the thread count, and torchrun sets 1
            # thread per rank where one process takes the machine's: fixed, the bits follow.
            raise UserError("parallel.exact_elastic on a CPU needs train.cpu_threads set (the same per-rank thread "
                            "count at every world size, e.g. 1)")
        numerics.apply(self.cfg.train.cpu_threads)
        numerics.warn_of_open_residual(self.device.type)

    def _decide_on_buffers(self, step: StepModule, setting: bool | str) -> None:
        """Exact elastic mode kept, refused or turned off (`exact_mode.with_buffers`, the user's
        `setting`) by the buffers one forward of the first micro-batch (own stream) updates; logged."""
        updated = []
        if self.exact and not is_iterator_source(self.data.train):  # an iterator is refused: _open_stream
            def forward() -> None:
                batch = next(eval_batches(self.data.train, self.batch_size, 1, self.data.collate))
                step(to_device(batch.inputs, self.device, copy=True), self._info(0))

            self.model.train()
            with micro_batch_streams(self.cfg.train.seed, 0, self.device) as use_streams, self._autocast():
                use_streams(0)
                updated = updated_buffers(self.model, forward)
            if self.sharded:
                reshard(self.model)
            self.exact, self.exact_why = with_buffers(setting, (True, self.exact_why), updated)
            self.cfg = with_mode(self.cfg, self.exact)  # the batch shape stays: global_batch / batch_size / W
        log.info("exact elastic mode", on=self.exact, why=self.exact_why, **({"buffers": updated} if updated else {}))

    def _hf_config(self) -> dict[str, Any] | None:
        """A transformers model's config.json (harness.models.hf), kept in every checkpoint's meta:
        `harness ckpt export --format hf` writes it. None for other models."""
        hf_config = getattr(self.model, "hf_config", None)
        return hf_config() if callable(hf_config) else None

    def _load_initial_weights(self, fresh: bool) -> dict[str, Any] | None:
        """`model.init_from` loaded into a fresh start's model (what was read), else None. Whole
        tensors by name, so before any sharding."""
        if fresh and self.cfg.model.init_from is not None:
            return load_initial_weights(self.model, self.cfg.model.init_from)
        return None

    def _shard(self) -> bool:
        """Shard the model with FSDP2 when `parallel.strategy = "fsdp"` in a group; whether it is.
        FSDP2 swaps the parameters for DTensors, so this runs before the optimizers see them."""
        cfg = self.cfg
        if self.world_size > 1 and cfg.parallel.strategy == "fsdp":
            if isinstance(self.model, torch.nn.ModuleDict):
                # FSDP2 gathers a root's parameters in the root's forward, which a task calling its
                # models one by one never runs.
                raise UserError(f"parallel.strategy = 'fsdp' shards one model, and task {self.task.name!r} has "
                                f"several ({', '.join(self.model)}): train it with strategy 'ddp', or return one "
                                "module from models() that calls the others in its forward")
            shard_model(self.model, cfg.parallel, self.device, self.world_size)
            return True
        if cfg.parallel.strategy == "fsdp":
            log.warning("parallel.strategy = 'fsdp' with one process: nothing to shard, the whole model trains here "
                        "(a sharded checkpoint loads into it); start several ranks with torchrun to shard")
        return False

    def _build_optimizer(self) -> tuple[Any, Any]:
        """The optimizer bundle and its schedulers over the model's (sharded) parameters: the
        task's own, or the `[optim]` config's (which a task with its own must not set: it would
        be ignored)."""
        own = self.task.optimizers(self.model, self.context)
        if own is not None:
            if self.cfg.optim != RunConfig().optim:
                raise UserError(f"[optim] is set, but task {self.task.name!r} builds its own optimizers (its "
                                "optimizers() returned them), so [optim] would be ignored: remove it")
            return own
        try:
            return build_bundle(self.cfg.optim, self.model, total_steps=self.cfg.train.steps)
        except OptimError as e:  # the optimizers' user error (optim imports nothing from the harness)
            raise UserError(str(e)) from None

    def _wrap_ddp(self, step: StepModule) -> torch.nn.Module:
        """What forward and backward go through: the step module in the DDP wrapper in a
        replicated group (its backward all-reduces the gradients before any optimizer, Muon's
        orthogonalisation included, sees them; with a task's own `step`, whose optimizers step at
        their cadences, a micro-batch may leave parameters without a gradient, which DDP is told
        to look for), else the step module itself: under FSDP the model is its own wrapper (its
        backward reduce-scatters the gradients), and exact elastic mode sums the gradients
        itself, in its tree's order. `self.model`, the inner module, stays the state part, so
        parameter names stay unprefixed."""
        if self.world_size > 1 and not self.sharded and not self.exact:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device] if self.device.type == "cuda" else None
            return DistributedDataParallel(step, device_ids=device_ids, find_unused_parameters=self.task.has_step)
        return step

    def _seed_rank(self) -> None:
        """In a group, reseed this rank's generators from (run seed, rank): dropout differs by rank
        (as the samples do), and each rank's stream is its `rng` part. Exact elastic mode draws
        only from per-micro-batch streams, so there every rank keeps the run seed's."""
        if self.world_size > 1 and not self.exact:
            seed_everything(derive_seed(self.cfg.train.seed, self.rank))

    def _compile(self, net: torch.nn.Module) -> torch.nn.Module:
        """`net` compiled when `train.compile` is set, else `net`. Only what the step calls is
        compiled: `self.model` stays the plain module, so the state part (and every checkpoint)
        keeps unprefixed parameter names (no `_orig_mod.`)."""
        if self.cfg.train.compile:
            # A compiled Module is an OptimizedModule (a Module); torch.compile's overloads type it as a callable.
            return cast(torch.nn.Module, torch.compile(net, options=compile_options(self.device)))
        return net

    def _mixed_precision(self) -> tuple[Callable[[], Any], torch.amp.GradScaler]:
        """The autocast context factory of `train.precision` and the grad scaler (enabled for fp16 only)."""
        precision = self.cfg.train.precision
        amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        autocast = (lambda: torch.autocast(self.device.type, dtype=amp_dtype)) if amp_dtype else nullcontext
        return autocast, torch.amp.GradScaler(self.device.type, enabled=precision == "fp16")

    def _register_state(self) -> None:
        """Register every resumable part in `self.state`, in the order checkpoints list them;
        `fingerprints` last, as it hashes all the others."""
        state = self.state
        state.register("model", self.model, sharded=self.sharded)
        state.register("optim", self.optim, sharded=self.sharded)
        state.register("sched", self.sched)
        state.register("data", self.stream, per_rank=True)  # the cursor: global, cheap to keep per rank
        state.register("scaler", self.scaler)
        state.register("trainer", self.counters)
        for name, part in self.task.state().items():  # the task's extra state: an EMA, a counter
            state.register(name, part, sharded=self.sharded and holds_dtensors(part))
        state.register("rng", RNGState(self.device), per_rank=True, kept_on_new_rank=True)
        state.register("fingerprints", self.fingerprints)

    def _open_stream(self) -> BatchStream | IteratorStream:
        """The harness's global order over a map-style source, or a user's stateful iterator as it is."""
        cfg, data = self.cfg, self.data
        if not is_iterator_source(data.train):
            # Exact elastic mode reads a rank's whole block of micro-batches of a step at once.
            return BatchStream(data.train, self.batch_size * (self.grad_accum if self.exact else 1), cfg.train.seed,
                               rank=self.rank, world_size=self.world_size, num_workers=cfg.data.num_workers,
                               pin_memory=self.device.type == "cuda", contiguous=self.exact, collate=data.collate)
        if self.exact:
            raise UserError("parallel.exact_elastic needs a map-style dataset (the harness's own order cuts the "
                            "canonical micro-batches); a data.factory iterator cannot: set exact_elastic = false")
        if cfg.data.num_workers:
            raise UserError(f"data.num_workers = {cfg.data.num_workers} with a data.factory iterator: the harness "
                            "reads an iterator in the training process, so its state_dict matches the batches "
                            "trained on; set data.num_workers = 0 (read ahead inside the iterator if needed)")
        return IteratorStream(data.train, self.batch_size, data.sample, rank=self.rank, world_size=self.world_size,
                              collate=data.collate)

    @property
    def step(self) -> int:
        return self.counters.step

    def train_step(self) -> StepResult:
        """One optimizer step over `grad_accum` micro-batches. Raises TrainingDiverged on NaN/inf."""
        t0 = time.perf_counter()
        self.model.train()
        data_s = self._skip_rolled_back_batches()
        batch_no = self.counters.anomalies.next_batch(self.step)
        accumulate = self._exact_micro_batches if self.exact else self._micro_batches
        loss_value, tokens, sample_ids, micro_data_s, names = accumulate(batch_no)
        data_s += micro_data_s
        # Host clock, no extra device sync: exact on CPU. On CUDA the loss read above has synced,
        # but the optimizer's kernels may still run at t_end, so there it is approximate (low).
        t_optim = time.perf_counter()
        stepping = self._stepping(names)
        grad_norm = math.nan
        # GradScaler reads param_groups and calls step(), which MultiOpt has: it types them a torch Optimizer.
        as_optimizer = cast(torch.optim.Optimizer, stepping)
        if math.isfinite(loss_value):
            self.scaler.unscale_(as_optimizer)
            grad_norm = self._clip_gradients(stepping if names is not None else None)
        self._stop_if_diverged(loss_value, grad_norm, batch_no)
        lr = self.sched.get_last_lr()  # what this step updates with: stepping the schedulers sets the next step's
        self.scaler.step(as_optimizer)
        self.scaler.update()
        self.sched.step(names)
        self.optim.zero_grad(set_to_none=True)  # also the gradients of the optimizers that did not step
        self.task.after_step(self.model, self._info(0, tuple(stepping.optimizers)))
        t_end = time.perf_counter()
        self.counters.record(loss_value, tokens)
        if self.cfg.train.spike_threshold is not None:
            self.counters.anomalies.observe(loss_value, self.cfg.train.spike_window)
        fingerprint = self.fingerprints.take(self.step, loss_value, {"sample_ids": self._global_ids(sample_ids)}, lr)
        return StepResult(self.step, loss_value, grad_norm, lr, tokens, t_end - t0, t_end - t_optim,
                          fingerprint=fingerprint, data_seconds=data_s)

    def _info(self, k: int, stepped: tuple[str, ...] = ()) -> StepInfo:
        """Where this rank's micro-batch `k` of the step being trained lies (contract.py)."""
        return StepInfo(step=self.step + 1, micro_batch=self.rank * self.grad_accum + k,
                        micro_batches=self.grad_accum * self.world_size, rank=self.rank, world_size=self.world_size,
                        stepped=stepped)

    def _stepping(self, names: tuple[str, ...] | None) -> MultiOpt:
        """The bundle of the optimizers that step now: all (None), or those a task's step named
        (one bundle per set, kept: the grad scaler keys its state by the optimizer object)."""
        if names is None:
            return self.optim
        if names not in self._bundles:
            unknown = sorted(set(names) - set(self.optim.optimizers))
            if unknown:
                raise UserError(f"task {self.task.name!r}: step() names optimizer {unknown[0]!r}; its optimizers are "
                                f"{sorted(self.optim.optimizers)}")
            self._bundles[names] = MultiOpt({n: self.optim.optimizers[n] for n in names})
        return self._bundles[names]

    def _forward(self, inputs: Any, k: int, names: list[tuple[str, ...] | None]) -> torch.Tensor:
        """Micro-batch `k`'s loss through the step module (the first forward watched for stateful
        non-persistent buffers); the optimizers it names go into `names`, which every micro-batch
        of a step must agree on."""
        with self._autocast():
            loss, stepping = self.net(inputs, self._info(k))
        if self._buffer_probe is not None and self._buffer_probe.done:
            self._check_buffers()
        stepping = None if stepping is None else tuple(sorted(stepping))
        if names and names[0] != stepping:
            raise UserError(f"task {self.task.name!r}: step() named optimizers {names[0]} for one micro-batch of step "
                            f"{self.step + 1} and {stepping} for another; every micro-batch of a step must step the "
                            "same optimizers (decide by info.step)")
        names[:1] = [stepping]
        return loss

    def _micro_batches(self, batch_no: int) -> tuple[float, int, list[torch.Tensor], float, tuple[str, ...] | None]:
        """Forward and backward of this rank's `grad_accum` micro-batches, the gradients reduced by
        DDP's (FSDP's) own collective; returns (the loss, mean over all ranks; tokens over all ranks;
        this rank's sample ids per micro-batch; seconds waited for data; the optimizers to step)."""
        accum = self.grad_accum
        total = torch.zeros((), device=self.device)
        tokens = 0
        sample_ids = []
        data_s = 0.0
        names: list[tuple[str, ...] | None] = []
        for i in range(accum):
            t_data = time.perf_counter()
            batch = next(self.stream)
            data_s += time.perf_counter() - t_data
            if self.batch_hook is not None:
                self.batch_hook(self.step + 1, batch)
            sample_ids.append(batch.sample_ids)
            # From pinned memory (a CUDA device, loader workers) the copy overlaps; otherwise it is the same copy.
            inputs = to_device(batch.inputs, self.device)
            # DDP all-reduces (FSDP reduce-scatters) in the last micro-batch's backward only: the sum is the same.
            with self._accumulating(i < accum - 1):
                loss = self._forward(inputs, i, names)
                self.scaler.scale(loss / accum).backward()
            total += loss.detach().float()
            tokens += self.task.tokens(batch.inputs)
        total = debug_hooks.poisoned(self.cfg.debug, self.rank, batch_no, total)  # the all-reduce spreads it
        if self.world_size > 1:  # every rank logs, digests and checks the mean over all ranks
            torch.distributed.all_reduce(total)
            tokens *= self.world_size
        loss_value = float(total) / (accum * self.world_size)
        return loss_value, tokens, sample_ids, data_s, names[0]

    def _exact_micro_batches(self, batch_no: int) -> tuple[float, int, list[torch.Tensor], float,
                                                           tuple[str, ...] | None]:
        """`_micro_batches` of `parallel.exact_elastic` (harness/parallel/exact.py): this rank's contiguous
        block of the step's canonical micro-batches, each drawing its random numbers from (seed,
        step, its index v) and leaving its own gradient, summed over the fixed tree and then
        across ranks in the tree's order; the loss is the exactly rounded mean over all of them."""
        t_data = time.perf_counter()
        block = next(self.stream)
        data_s = time.perf_counter() - t_data
        if self.batch_hook is not None:
            self.batch_hook(self.step + 1, block)
        params = [p for p in self.model.parameters() if p.requires_grad]
        micro_batches = self.grad_accum * self.world_size
        take = self._fsdp_gradients.take if self._fsdp_gradients is not None else None  # set when sharded
        if self.sharded:  # FSDP keeps each micro-batch's whole gradient; the tree sums them
            cast("FSDPModule", self.model).set_requires_gradient_sync(False)  # fully_shard swapped its class
        tree = exact.SumTree()
        used = torch.zeros(len(params), dtype=torch.bool)
        losses = []
        names: list[tuple[str, ...] | None] = []
        first = self.rank * self.grad_accum
        with micro_batch_streams(self.cfg.train.seed, self.step + 1, self.device) as use_streams:
            for k, piece in enumerate(split_batch(block.inputs, self.batch_size)):
                # A fresh copy of each micro-batch: the same shape and alignment whichever block it came in.
                piece = to_device(piece, self.device, copy=True)
                use_streams(first + k)
                loss = self._forward(piece, k, names)
                self.scaler.scale(loss / micro_batches).backward()
                tree.push(exact.flat_gradients(params, used, take))
                losses.append(loss.detach())
        block_losses = torch.stack(losses)
        block_losses = debug_hooks.poisoned(self.cfg.debug, self.rank, batch_no, block_losses)
        used = exact.used_anywhere(used, self.world_size, self.device)
        if self.sharded:
            exact_fsdp.reduce_scatter_blocks(tree.result(), exact_fsdp.ShardLayout(params, self.world_size, self.rank),
                                             used)
        else:
            exact.set_gradients(params, exact.reduce_blocks(tree.result(), self.world_size), used)
        loss_value = exact.mean_over_micro_batches(block_losses, self.world_size)
        tokens = self.task.tokens(block.inputs) * self.world_size
        return loss_value, tokens, [block.sample_ids], data_s, names[0]

    def _accumulating(self, more: bool):
        """The context of one micro-batch's backward: no gradient reduction when `more` follow."""
        if self.sharded:
            cast("FSDPModule", self.model).set_requires_gradient_sync(not more)  # fully_shard swapped its class
            return nullcontext()
        # Several replicated ranks: `net` is the DDP wrapper (_wrap_ddp); compiled, it passes attributes through.
        return cast("DistributedDataParallel", self.net).no_sync() if self.world_size > 1 and more else nullcontext()

    def materialize_optimizer_state(self) -> None:
        """Create the optimizers' state now (a sharded checkpoint loads into live tensors only)."""
        materialize_optimizer_state(self.optim.optimizers)

    def _global_ids(self, per_micro_batch: list[torch.Tensor]) -> torch.Tensor:
        """The sample ids of the whole global batch in cursor order, the same for any world size:
        micro-batch by micro-batch, rank r's row b is global position b * world + r (order.py)."""
        if self.world_size == 1:
            return torch.cat(per_micro_batch)
        ids = torch.stack(per_micro_batch).to(self.device)  # [accum, batch]; NCCL gathers on the GPU
        gathered = [torch.empty_like(ids) for _ in range(self.world_size)]
        torch.distributed.all_gather(gathered, ids)
        if self.exact:  # one contiguous block per rank: rank order is cursor order
            return torch.cat(gathered).reshape(-1).cpu()
        return torch.stack(gathered, dim=2).reshape(-1).cpu()  # [accum, batch, world] -> cursor order

    def _check_buffers(self) -> None:
        """After the watched first forward, before its backward: apply the completeness policy to
        the non-persistent buffers that carry state, and let the fingerprints blame them."""
        assert self._buffer_probe is not None  # _forward calls this while the probe watches
        stateful = self._buffer_probe.stateful
        self._buffer_probe = None
        check_buffers(stateful, self.cfg.train.unregistered_state)
        if stateful:
            self.fingerprints.note_unsaved(stateful, self.step + 1)

    def _clip_gradients(self, stepping: MultiOpt | None) -> float:
        """The global gradient norm (one fused norm, one host sync) of the parameters whose
        optimizers step (`stepping`; None: all), clipping to train.grad_clip; in the model's
        order of parameters, whichever optimizers step."""
        owned = None if stepping is None else {id(p) for g in stepping.param_groups for p in g["params"]}
        params = [p for p in self.model.parameters() if p.grad is not None and (owned is None or id(p) in owned)]
        max_norm = self.cfg.train.grad_clip if self.cfg.train.grad_clip is not None else math.inf
        if self.exact:  # in an order no sharding changes
            return exact.clip_gradients(params, max_norm, self.world_size, device=self.device, sharded=self.sharded)
        return float(full_value(torch.nn.utils.clip_grad_norm_(params, max_norm)))

    def _skip_rolled_back_batches(self) -> float:
        """Draw and discard the step-batches a rollback marked to skip (harness/health/anomaly.py)
        when the next step would train on them; returns the seconds spent drawing them."""
        ledger = self.counters.anomalies
        t0 = time.perf_counter()
        while ledger.next_batch(self.step) in ledger.skip:
            for _ in range(1 if self.exact else self.grad_accum):  # exact mode reads a step's block at once
                next(self.stream)
            ledger.skipped += 1
        return time.perf_counter() - t0

    def _stop_if_diverged(self, loss: float, grad_norm: float, batch_no: int) -> None:
        """Raise TrainingDiverged, on every rank, before the optimizer step when the loss or the
        gradient norm is NaN/inf on any rank, or the loss is a spike (`train.spike_threshold`).
        With fp16 the grad scaler owns non-finite gradients: it skips such a step and lowers its
        scale, as dynamic loss scaling intends. The error carries the `Anomaly` (the loop rolls
        back on it with `train.on_anomaly = "rollback"`)."""
        # Already agreed across ranks without a collective of its own: `loss` is the all-reduced
        # mean and DDP all-reduced the gradients, so a NaN/inf on one rank is on every rank here.
        t = self.cfg.train
        anomaly = detect(self.counters.anomalies, self.step + 1, batch_no, loss, grad_norm,
                         grads_checked=not self.scaler.is_enabled(), spike_threshold=t.spike_threshold,
                         spike_window=t.spike_window)
        if anomaly is None:
            return
        self.optim.zero_grad(set_to_none=True)
        what = anomaly.describe() if anomaly.cause != "nonfinite_grad" else \
            f"gradient norm is {grad_norm} (loss {loss:.6g}) at step {anomaly.step}"
        raise TrainingDiverged(f"{what}; the step was not applied and no checkpoint of it was written. "
                               f"{DIVERGED_ADVICE}", anomaly)

    def check_finite_state(self) -> None:
        """Raise TrainingDiverged, on every rank, when a parameter, buffer or optimizer tensor holds
        NaN/inf: called before every save, so a poisoned state never becomes a checkpoint. One
        reduction per tensor where it lies and one host sync (repro/finite.py)."""
        named = [(f"model/{n}", t) for n, t in (*self.model.named_parameters(), *self.model.named_buffers())]
        for opt_name, opt in self.optim.optimizers.items():
            names = {id(p): n for g in opt.param_groups for n, p in zip(g["param_names"], g["params"], strict=True)}
            named += [(f"optim/{opt_name}/{names.get(id(p), '?')}/{k}", v)
                      for p, st in opt.state.items() for k, v in st.items() if isinstance(v, torch.Tensor)]
        bad = first_nonfinite([(n, local(t).detach()) for n, t in named if t.is_floating_point() and t.numel()])
        # Agreed across this trainer's ranks only: a one-process trainer may live in a rank of a group.
        if distributed.all_ok(bad is None) if self.world_size > 1 else bad is None:
            return
        raise TrainingDiverged(f"{bad or 'a tensor on another rank'} holds NaN/inf after step {self.step}; no "
                               f"checkpoint of this state was written (the newest checkpoint is of an earlier "
                               f"step). {DIVERGED_ADVICE}")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The task's metrics over a fixed set of held-out batches (`eval_<metric>` -> value; the
        built-in: `eval_loss`, the mean loss); draws no random numbers."""
        self.model.eval()
        batches = eval_batches(self.data.eval, self.batch_size, self.cfg.train.eval_batches, self.data.collate)
        with self._autocast():
            metrics = self.task.evaluate(self.model, (to_device(b.inputs, self.device) for b in batches))
        if self.sharded:
            reshard(self.model)
        self.model.train()
        return metrics

    def close(self) -> None:
        self.stream.close()

