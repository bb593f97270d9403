"""The run config: typed pydantic models loaded from TOML, overridden with `--set key=value`.

Contract:
- Every section forbids unknown keys; a mistake is a `UserError` naming the key and where it was
  set: the file (for an inherited key, the file it came from) or "command line".
- Files, `extends`, `unset` and `--set` (`null` unsets a key) are layered by
  harness/config_layers.py; this module validates the result.
- `math_fields()` lists the keys that decide the numbers a run produces. Resuming with any of them
  changed is refused unless explicitly allowed; everything else (logging, checkpoint cadence,
  retention, eval cadence, worker count) may change between restarts.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harness.config_layers import Layers, flatten, read_layers
from harness.errors import UserError
from optim.config import ARMS, OptimConfig, arms_taking, parse_optim_config

# The built-in GPT (harness/models/gpt.py), named by its path so that reading a config imports no
# model code (and no torch).
DEFAULT_FACTORY = "harness.models.gpt:build_gpt"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    """The model: a factory import path and the keyword arguments it is called with."""

    factory: str = Field(
        DEFAULT_FACTORY,
        description=(
            "`package.module:function` called with one dict (`args`, plus `seq_len` from data.seq_len unless `args` "
            "sets it) that returns the nn.Module; its forward(x, y) returns (logits, loss). The full contract: "
            "docs/models.md."
        ),
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Arguments for the factory (for the built-in GPT: n_layer, n_head, d_model, dropout, vocab_size; seq_len "
            "follows data.seq_len, set it here only to make the model longer than the samples)."
        ),
    )
    init_from: str | None = Field(
        None,
        description=(
            "Start from these weights: a safetensors file, or a folder holding model.safetensors (or "
            "model.safetensors.index.json and its shards), e.g. a Hugging Face model folder or `harness ckpt "
            "export`'s; every tensor of the model's state dict is loaded by name (converted to its dtype) at step 0 "
            "only, and the files' sha256 digests go into run.json. A resume never reads them again; resuming with "
            "another value is a config change."
        ),
    )


class DataSource(Section):
    """One prepared token-shard dataset (`harness data prepare`) and its share of the mixture."""

    url: str = Field(description="Local path or fsspec URL of the dataset folder (the one holding index.json).")
    weight: float = Field(
        1.0, gt=0, description="Relative share of this source in every epoch (harness/data/mixture.py)."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options for this source; unset = data.storage_options."
    )


class DataSection(Section):
    """The token stream: byte-level tokens from a text file at any fsspec URL, or prepared
    token shards (`sources`)."""

    url: str | None = Field(
        None,
        description=(
            "fsspec URL or path of a text file (byte tokens); unset = the built-in corpus (no download). Not together "
            "with `sources`."
        ),
    )
    sources: list[DataSource] = Field(
        default_factory=list,
        description=(
            "Token-shard datasets mixed by weight, e.g. [{url = \"data/a\", weight = 0.7}, "
            "{url = \"s3://b/c\", weight = 0.3}]; empty = the byte-text `url`. Their index hashes and weights are "
            "recorded in every checkpoint, and resuming on other data is refused."
        ),
    )
    eval_sources: list[DataSource] = Field(
        default_factory=list,
        description=(
            "Token-shard datasets to evaluate on, read whole (same tokenizer as sources); then training uses all of "
            "the sources. Empty = hold out the last eval_fraction of each source's windows, cut at a document end "
            "nearby."
        ),
    )
    factory: str | None = Field(
        None,
        description=(
            "`package.module:function` of your own dataset: called with `args` plus seq_len, seed, rank and "
            "world_size, it returns (train, eval) map-style sample sources, or a stateful iterator (state_dict / "
            "load_state_dict) to train on (contract: harness/data/factory.py). Not together with url or sources."
        ),
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Arguments for data.factory.")
    hash_check: Literal["off", "first-open", "always"] = Field(
        "first-open",
        description=(
            "sha256 of a shard against its index: never, the first time it is opened, or every time a process opens it "
            "(sizes are always checked)."
        ),
    )
    seq_len: int = Field(
        64, gt=0, description="Tokens per sample (the model sees seq_len tokens and predicts the next of each)."
    )
    batch_size: int = Field(16, gt=0, description="Samples per micro-batch (per rank).")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes; the data order does not depend on it.")
    eval_fraction: float = Field(
        0.05, gt=0.0, lt=1.0,
        description="Fraction of the windows held out for evaluation (> 0: every run ends with an evaluation).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options for `url` (and every source without its own)."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> DataSection:
        kinds = [name for name, set_ in (("url", self.url is not None), ("sources", bool(self.sources)),
                                          ("factory", self.factory is not None)) if set_]
        if self.eval_sources and not self.sources:
            raise ValueError("eval_sources needs sources (token shards to train on)")
        if len(kinds) > 1:
            raise ValueError(f"set one of url (a text file), sources (token shards) or factory (your dataset), "
                             f"not {' and '.join(kinds)}")
        return self


class TrainSection(Section):
    """The step loop."""

    steps: int = Field(200, gt=0, description="Optimizer steps of the whole run.")
    seed: int = Field(0, description="Seed of model init, dropout and the data order.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step.")
    global_batch: int | None = Field(
        None, gt=0,
        description=(
            "Samples per optimizer step over all ranks: data.batch_size x grad_accum x world size must equal it. The "
            "one of batch_size / grad_accum not set in the config is derived from it (grad_accum when neither is), so "
            "the batch stays the same for any number of ranks (one a base config sets: `unset` it); unset = batch_size "
            "x grad_accum x world size."
        ),
    )
    grad_clip: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this value; inf = no clipping."
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast dtype for forward/backward; fp16 uses a saved grad scaler."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to train; auto = cuda when available.")
    compile: bool = Field(
        False,
        description=(
            "torch.compile the training forward and backward (inductor; evaluation stays eager; on a CPU dropout keeps "
            "ATen's random-number kernels, inductor's fallback_random, which are faster there). Checkpoints keep the "
            "plain parameter names, so compiled and eager runs read each other's checkpoints; compiled kernels round "
            "differently from eager ones, so the setting is part of the run's math: resuming under the other one needs "
            "--allow-config-change."
        ),
    )
    cpu_threads: int | None = Field(
        None, gt=0,
        description=(
            "torch's intra-op CPU threads, fixed for the run and recorded in run.json and every checkpoint "
            "(harness/repro/numerics.py); unset = torch's default for this machine. A resume with another count "
            "warns: some kernels split their sums by it."
        ),
    )
    eval_every: int = Field(
        0, ge=0,
        description=(
            "Evaluate every N optimizer steps (0 = only at the end); the last step is evaluated once, at the end."
        ),
    )
    eval_batches: int = Field(4, gt=0, description="Batches per evaluation.")
    log_every: int = Field(10, gt=0, description="Console log line every N steps (metrics.jsonl gets every step).")
    fingerprint_every: int = Field(
        100, ge=0,
        description=(
            "Every N steps, hash every parameter, buffer and optimizer tensor into the step's fingerprint "
            "(metrics.jsonl `state_hash`; 0 = only at checkpoints). Costs a copy of the state to the CPU and a sha256 "
            "over it. The loss and batch hash are recorded every step regardless."
        ),
    )
    on_divergence: Literal["error", "warn"] = Field(
        "warn",
        description=(
            "After a resume, when a re-run step's fingerprint differs from the one the interrupted process recorded "
            "(or the restored state from the saved one): stop with an error, or log a resume_mismatch event and go on."
        ),
    )
    unregistered_state: Literal["error", "warn"] = Field(
        "error",
        description=(
            "Before training: an optimizer, scheduler, grad scaler, generator or other stateful object reachable from "
            "the trainer that is not a registered state part (so a checkpoint would not hold it) is an error, or only "
            "a warning; likewise a non-persistent buffer that the first forward reads before writing and then updates "
            "(an EMA)."
        ),
    )
    on_anomaly: Literal["stop", "rollback"] = Field(
        "stop",
        description=(
            "What a NaN/inf loss or gradient norm (always checked) or a loss spike (`spike_threshold`) does, on every "
            "rank at the same step (the loss is all-reduced): stop with exit 2 before the optimizer step, or roll back "
            "to the newest good checkpoint before it, skip the batches that caused it and go on "
            "(harness/health/anomaly.py; docs/health.md). The skipped batches are checkpointed, so a resumed run "
            "repeats the same rollbacks."
        ),
    )
    spike_threshold: float | None = Field(
        None, gt=0,
        description=(
            "A loss above median + spike_threshold x MAD (scaled to a standard deviation) of the last `spike_window` "
            "losses is a spike (an anomaly); unset = spikes are not checked, only NaN/inf."
        ),
    )
    spike_window: int = Field(
        100, ge=8,
        description=(
            "Recent losses the spike threshold is computed from; no spike is called before half of them are seen."
        ),
    )
    rollback_skip: int = Field(
        1, ge=1,
        description=(
            "On a rollback, skip this many optimizer steps' worth of batches, ending with the one that caused the "
            "anomaly."
        ),
    )
    max_rollbacks: int = Field(
        3, ge=1,
        description=(
            "At most this many rollbacks within `rollback_window` steps; one more anomaly there stops the run (exit "
            "2), naming the steps."
        ),
    )
    rollback_window: int = Field(1000, ge=1, description="The span of steps `max_rollbacks` counts in.")


class LocalTierSection(Section):
    """The local checkpoint tier (docs/checkpoint-tiers.md): frequent checkpoints on node-local disk
    or tmpfs that a restart on the same machine recovers from before the run dir."""

    dir: str = Field(
        description=(
            "Local folder of the tier (node-local disk such as /local/nvme/ckpt, or a tmpfs such as /dev/shm for a "
            "RAM tier: it survives the process, not the node). Checkpoints go to DIR/<run id>/rank-NNNNN/, so one "
            "run never finds another's."
        ),
    )
    every_steps: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        description=(
            "Save a local checkpoint every N optimizer steps, or \"auto\": as checkpoint.every_steps = \"auto\" with "
            "this tier's own measured save time (save once after the first step, then every sqrt(2 * blocking_s * "
            "mtbf) seconds' worth of steps; checkpoint.mtbf_hours), logged with its inputs and tier = \"local\"."
        ),
    )
    keep: int = Field(2, ge=2, description="Local checkpoints kept (>= 2: the newest may be one a crash cut short).")
    peer_jump: int | None = Field(
        None, ge=0,
        description=(
            "With several ranks, each rank's local checkpoints are also copied to rank (rank + peer_jump) mod world "
            "size, into its local folder (DIR/<run id>/peer-of-rank-NNNNN/), so a node that is gone with its disk "
            "loses nothing that a peer holds. Unset: LOCAL_WORLD_SIZE from torchrun (the same local rank on the next "
            "node; a launcher that does not set it gets none); 0, or a multiple of the world size: no peer copies."
        ),
    )


class CheckpointSection(Section):
    """When and how checkpoints are written; none of these change the math."""

    every_steps: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        50,
        description=(
            "Checkpoint every N optimizer steps (0 = off; the final step is always saved), or \"auto\": save once "
            "after the first step, measure the blocking save time and the mean step time, then save every sqrt(2 * "
            "blocking_s * mtbf) seconds' worth of steps (Young/Daly), logged with its inputs."
        ),
    )
    mtbf_hours: float = Field(
        24.0, gt=0.0,
        description=(
            "Expected mean time between failures (crash, node loss, preemption) of this job, in hours; used by "
            "every_steps = \"auto\"."
        ),
    )
    async_save: bool = Field(
        True,
        description=(
            "Snapshot the state into reusable CPU buffers at the step boundary and persist it in a background thread, "
            "so the step loop blocks only for the copy; false = write the checkpoint inside the step loop. The files "
            "are byte-identical either way."
        ),
    )
    staging_mib: Annotated[int, Field(ge=64)] | None = Field(
        None,
        description=(
            "With async_save, the host memory a background save stages the tensor files through, in MiB (at least "
            "64; unset: as large as the state). With less than the state the step loop waits at a save until the "
            "writer has drained all but this much (harness/checkpoint/save/staging_ring.py)."
        ),
    )
    when_busy: Literal["wait", "skip"] = Field(
        "wait",
        description=(
            "With async_save, when a save is due while the previous one is still being persisted: wait for it, or skip "
            "this save (logged). The final and the preemption save always wait."
        ),
    )
    every_minutes: float = Field(
        0.0, ge=0.0, description="Also checkpoint when this many minutes passed since the last one (0 = off)."
    )
    keep_last: int = Field(
        3, ge=2, description="Keep the newest K checkpoints (>= 2: the newest may be the one a crash interrupted)."
    )
    keep_every: int = Field(0, ge=0, description="Also keep every checkpoint whose step is a multiple of M (0 = none).")
    preempt_signals: list[str] = Field(
        ["SIGTERM", "SIGINT", "SIGUSR1"], description="Signals that request a save-and-exit at the next step boundary."
    )
    preempt_deadline_s: float = Field(
        25.0, gt=0,
        description=(
            "Seconds a preemption save may take before the process exits without it (the previous checkpoint stays)."
        ),
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options for the run dir (e.g. endpoint_url for S3)."
    )
    save_deadline_s: float = Field(
        1800.0, gt=0,
        description=(
            "A background save (async_save) that has not committed this many seconds after it started is given up: the "
            "run stops with exit 69 (STORAGE_UNAVAILABLE, retryable), naming the step; the previous checkpoint stays "
            "the newest good one. While a save runs longer than the larger of 30 s and twice the previous save's time, "
            "a warning (and a `save_slow` event) says so, again each such interval."
        ),
    )
    lease_heartbeat_s: float = Field(
        30.0, gt=0,
        description=(
            "The writer refreshes the run dir's lease (lease.json) this often, from a thread. Another process takes "
            "the lease over without --takeover once it has missed 4 heartbeats (4 x this value, judged by the interval "
            "the holder recorded), or at once when the holder's process is gone on the same host. Lower = a lost "
            "node's run is picked up sooner, at one small read and write of the run dir per heartbeat."
        ),
    )
    local: LocalTierSection | None = Field(
        None,
        description=(
            "[checkpoint.local]: a local checkpoint tier with its own cadence, used by `--resume auto` when it holds a "
            "newer checkpoint of this run that verifies (one process, DDP or FSDP: each rank keeps its own shards). "
            "Not `local_dir`, which only stages uploads."
        ),
    )
    local_dir: str | None = Field(
        None,
        description=(
            "Local-first persistence: commit each checkpoint to this local folder (one per run; the last 2 are kept), "
            "upload it to the run dir in the background, read every object back and check it, and only then publish it "
            "there (its manifest); the run dir stays the source of truth for resuming. Unset = write to the run dir "
            "directly. One process only."
        ),
    )


class ParallelSection(Section):
    """How a model is spread over the ranks of a torchrun group (docs/distributed.md)."""

    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description=(
            "With several ranks: \"ddp\" replicates the model and optimizer on every rank (DistributedDataParallel; "
            "rank 0 writes them); \"fsdp\" shards parameters, gradients and optimizer state over the ranks (FSDP2 "
            "fully_shard per block and on the root) and every rank writes its own shards "
            "(torch.distributed.checkpoint). One process has nothing to shard: it trains the whole model (a warning "
            "says so) and loads a sharded checkpoint all the same."
        ),
    )
    shard_modules: str = Field(
        r"(.*\.)?\d+",
        description=(
            "With fsdp: a regular expression; every module whose qualified name (model.named_modules()) matches it in "
            "full becomes its own FSDP unit (its parameters gathered for its forward/backward only), then the root "
            "takes the rest. The default matches the items of every ModuleList/Sequential (`h.0`, `blocks.11`): a "
            "transformer's blocks."
        ),
    )
    @field_validator("shard_modules")
    @classmethod
    def _a_regular_expression(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"{pattern!r} is not a regular expression ({e}); fix it, or unset it for the default"
            ) from None
        return pattern

    param_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description=(
            "With fsdp on CUDA: the dtype parameters are gathered and computed in (MixedPrecisionPolicy param_dtype); "
            "gradients are always reduced in fp32 and the sharded parameters and optimizer state stay fp32. Ignored on "
            "CPU (gloo), where fsdp computes in fp32 (a warning says so)."
        ),
    )
    exact_elastic: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "Make every step independent of the world size, bit for bit (harness/parallel/exact.py; "
            "docs/distributed.md, \"Exact elastic\"): the step's train.global_batch samples are cut into V = "
            "global_batch / data.batch_size canonical micro-batches in sample order, rank r of W takes the "
            "contiguous block r*V/W..(r+1)*V/W-1, each micro-batch draws its random numbers from (seed, step, "
            "micro-batch), and the gradients are summed over one fixed tree of the V micro-batches. Needs "
            "train.global_batch and data.batch_size set (train.grad_accum unset: it is V / W), "
            "train.cpu_threads set on a CPU and a map-style dataset; DDP and FSDP alike; the exact world sizes are "
            "1 and every W dividing V with V / W a power of two. \"auto\" (the default): on wherever those hold, "
            "and a run keeps the mode it started in (harness/run/exact_mode.py; the log and the start event say "
            "which mode runs and why); true: refuse what they do not allow; false: off."
        ),
    )


class HealthSection(Section):
    """The hang watchdog (harness/health/watchdog.py); none of these change the math."""

    hang_watchdog: bool = Field(
        True,
        description=(
            "Exit with code 79 (HUNG, restarted like a crash) after dumping every thread's stack to the log dir when a "
            "step, save, evaluation or collective takes longer than max(hang_factor x the median step time, "
            "hang_floor_s)."
        ),
    )
    hang_factor: float = Field(
        20.0, gt=1.0,
        description="A phase may take this many median step times (an evaluation: per eval batch over grad_accum).",
    )
    hang_floor_s: float = Field(
        600.0, gt=0.0,
        description="Lower bound of every limit, in seconds: covers slow checkpoints and stalls that are not hangs.",
    )
    first_step_s: float = Field(
        1800.0, gt=0.0,
        description=(
            "Limit for phases before this process has timed a step (compilation, loader workers starting, cache "
            "warm-up)."
        ),
    )


class LogSection(Section):
    """Where metrics go besides metrics.jsonl (which stays the source of truth)."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description=(
            "Experiment trackers fed by rank 0 with every step's metrics: \"tensorboard\" (pip install "
            "'harness[tensorboard]'; event files in LOG_DIR/tensorboard, re-run steps replace the old points), "
            "\"wandb\" (pip install 'harness[wandb]'; one W&B run per harness run, its id the run id, continued by "
            "every restart), \"mlflow\" (pip install 'harness[mlflow]'; one MLflow run per harness run, found again by "
            "its tag harness.run_id). A tracker that fails warns and never stops training."
        ),
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description=(
            "W&B: offline = write LOG_DIR/wandb only (no network; `wandb sync` uploads it), online = stream to the W&B "
            "server."
        ),
    )
    wandb_project: str = Field("harness", description="W&B project of the run.")
    mlflow_tracking_uri: str | None = Field(
        None,
        description=(
            "MLflow: the tracking server or store (e.g. http://mlflow:5000); unset = MLFLOW_TRACKING_URI from the "
            "environment, else a local store in LOG_DIR/mlruns."
        ),
    )
    mlflow_experiment: str = Field("harness", description="MLflow experiment of the run (created when missing).")


class DebugSection(Section):
    """Fault hooks for tests of the harness itself; never set in real runs."""

    crash_at_step: int | None = Field(
        None, description="Crash the process after this optimizer step (before its checkpoint)."
    )
    crash_mode: Literal["exit", "raise"] = Field(
        "exit", description="exit = os._exit(13); raise = an uncaught exception."
    )
    crash_once: bool = Field(True, description="Crash only the first time (a marker file in the log dir remembers).")
    step_sleep_s: float = Field(0.0, ge=0.0, description="Sleep after each step, to give kill tests a window.")
    persist_delay_s: float = Field(
        0.0, ge=0.0,
        description=(
            "Sleep this long in the background persist before writing (async_save), and before each background peer "
            "exchange of the local tier, to give tests a window in which a save or a peer copy is in flight."
        ),
    )
    fail_save_rank: int | None = Field(
        None, ge=0,
        description=(
            "With world size > 1: this rank fails half-way through writing its part of a checkpoint (at "
            "`fail_save_step`, or at every save), to test that no rank commits then."
        ),
    )
    fail_save_step: int | None = Field(
        None, ge=0, description="The step at which `fail_save_rank` fails its save; unset = every save."
    )
    hang_at_step: int | None = Field(
        None, ge=1,
        description=(
            "Hang forever (once: a marker in the log dir) while working on this step, where `hang_in` says: the step "
            "itself, or the data loading of it (in a loader worker when data.num_workers > 0)."
        ),
    )
    hang_in: Literal["step", "data"] = Field("step", description="Where `hang_at_step` hangs.")
    hang_rank: int = Field(0, ge=0, description="The rank that hangs (`hang_at_step`).")
    nan_at_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description=(
            "Poison the batches that these steps draw in a run without skips (step N's worth of batches): their loss "
            "becomes NaN on `nan_rank`. A rollback that skips such a batch does not meet it again."
        ),
    )
    spike_at_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description=(
            "Like `nan_at_steps`, but the loss of those batches is multiplied by 100 (a loss spike; the gradients are "
            "unchanged)."
        ),
    )
    nan_rank: int = Field(0, ge=0, description="The rank whose loss `nan_at_steps` and `spike_at_steps` poison.")
    sample_log: bool = Field(
        False,
        description=(
            "Each rank appends the sample ids of every batch to LOG_DIR/samples-rank-NNNNN.jsonl, to test the data "
            "split across ranks and world sizes."
        ),
    )


class RunConfig(Section):
    """Everything a run needs. `run_dir` is any fsspec URL; logs go to `log_dir`."""

    run_dir: str = Field(
        "runs/default",
        description="Where checkpoints and run.json go: a local path or any fsspec URL (s3://bucket/prefix).",
    )
    log_dir: str | None = Field(
        None, description="Local folder for events.jsonl/metrics.jsonl; unset = run_dir when local, else runs/<name>."
    )
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    optim: OptimConfig = Field(
        default_factory=lambda: _default_optim(),
        description="Optimizer bundle; `type` selects the arm (default adamw).",
    )
    train: TrainSection = Field(default_factory=TrainSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    health: HealthSection = Field(default_factory=HealthSection)
    log: LogSection = Field(default_factory=LogSection)
    debug: DebugSection = Field(default_factory=DebugSection)

    @model_validator(mode="after")
    def _model_fits_the_samples(self) -> RunConfig:
        longest = self.model.args.get("seq_len")
        if isinstance(longest, int) and longest < self.data.seq_len:
            raise ValueError(f"model.args.seq_len = {longest} is shorter than data.seq_len = {self.data.seq_len}: "
                             "remove model.args.seq_len (the model then follows data.seq_len) or raise it")
        return self


def model_args(cfg: RunConfig) -> dict[str, Any]:
    """The dict the model factory is called with: `model.args`, plus `seq_len` = data.seq_len
    unless `model.args` sets it. The math check compares these, so a config that spells out the
    default seq_len and one that leaves it to data.seq_len are the same run."""
    return {"seq_len": cfg.data.seq_len, **cfg.model.args}


def _default_optim() -> OptimConfig:
    return parse_optim_config({})


# Storage-option keys that hold credentials: never written to run.json, checkpoints or logs.
SECRET_KEYS = ("key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key",
               "aws_session_token", "session_token")


def public_config(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as JSON-able data with credentials in storage options redacted."""
    return _redact(cfg.model_dump(mode="json"))


def _redact(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: "<redacted>" if k.lower() in SECRET_KEYS and v is not None else _redact(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_redact(v) for v in tree]
    return tree


# Keys that may change between restarts of one run without changing its numbers. `data.url` is not
# among them (a text file's URL is part of its identity); `data.sources` holds URLs of token shards,
# which may move: what the numbers depend on (each index's sha256 and the weights) is recorded and
# checked as the data identity instead (harness/data/identity.py, harness/data/sources.py).
FREE_FIELDS = ("run_dir", "log_dir", "checkpoint", "health", "log", "debug", "data.num_workers", "data.storage_options",
               "data.sources", "data.eval_sources", "data.hash_check", "train.eval_every", "train.eval_batches",
               "train.log_every", "train.device", "train.cpu_threads",
               "train.fingerprint_every", "train.on_divergence", "train.unregistered_state",
               # Anomaly handling changes the numbers only at an anomaly, and what it did then (the
               # skipped batches) is checkpointed state: a resume repeats it under any of these.
               "train.on_anomaly", "train.spike_threshold", "train.spike_window", "train.rollback_skip",
               "train.max_rollbacks", "train.rollback_window",
               # Like the world size: the sum order of the gradient reduction, nothing else (a
               # sharded checkpoint loads into DDP or one process and back).
               "parallel.strategy", "parallel.shard_modules")


def batch_shape(cfg: RunConfig, world_size: int) -> tuple[int, int]:
    """(data.batch_size, train.grad_accum) for `world_size` ranks. With `train.global_batch` set,
    the one of the two the config leaves unset is derived (grad_accum when both are unset);
    raises UserError when global_batch != batch_size x grad_accum x world_size, saying which
    factors the config gave and what to change."""
    if cfg.parallel.exact_elastic is True:  # "auto" is decided by the run (harness/run/exact_mode.py)
        return exact_shape(cfg, world_size)
    batch_size, accum, target = cfg.data.batch_size, cfg.train.grad_accum, cfg.train.global_batch
    if target is None:
        return batch_size, accum
    accum_set = "grad_accum" in cfg.train.model_fields_set
    batch_set = "batch_size" in cfg.data.model_fields_set
    if not (accum_set and batch_set):  # derive the unset factor (grad_accum when both are unset)
        fixed, value, derived = (("data.batch_size", batch_size, "train.grad_accum") if not accum_set
                                 else ("train.grad_accum", accum, "data.batch_size"))
        per_step = value * world_size
        if target % per_step == 0:
            return (batch_size, target // per_step) if not accum_set else (target // per_step, accum)
        given = f"{fixed} = {value}{'' if accum_set or batch_set else ' (its default)'}"
        problem = f"{derived} (not set, so derived) would be {target} / ({value} x {world_size}), not a whole number"
        fix = f"make global_batch a multiple of {fixed} x world size ({per_step}), or change {fixed}"
    elif batch_size * accum * world_size == target:
        return batch_size, accum
    else:
        given = f"data.batch_size = {batch_size} and train.grad_accum = {accum}"
        problem = f"{batch_size} x {accum} x world size {world_size} is {batch_size * accum * world_size}"
        fix = (f"make global_batch {batch_size * accum} x the world size, or unset one of data.batch_size / "
               "train.grad_accum so it is derived (remove it from the config, or "
               '--set train.grad_accum=null; an inherited one: unset = ["train.grad_accum"] in the extending file)')
    valid = valid_world_sizes(cfg)
    where = (f"the valid world sizes for this config are {_listed(valid)}: run at one of those, or" if valid
             else "no world size splits it:")
    raise UserError(f"train.global_batch = {target} does not split over {world_size} rank(s) with {given}: "
                    f"{problem}; {where} {fix}")


def exact_shape(cfg: RunConfig, world_size: int) -> tuple[int, int]:
    """(data.batch_size, grad_accum) of `parallel.exact_elastic` at `world_size`: the canonical
    micro-batch is the config's data.batch_size, V = global_batch / batch_size of them make a
    step, and a rank accumulates its block of V / world_size. Raises UserError, naming the key to
    change, when the config leaves the micro-batch derived (or fixes grad_accum), when the global
    batch is no whole number of micro-batches, or when `world_size` is not exact for V
    (`exact_world_sizes`)."""
    target, batch_size = cfg.train.global_batch, cfg.data.batch_size
    if target is None or "batch_size" not in cfg.data.model_fields_set:
        raise UserError("parallel.exact_elastic needs train.global_batch and data.batch_size set (the canonical "
                        "micro-batch, the same at every world size): set both")
    if "grad_accum" in cfg.train.model_fields_set:
        raise UserError(f"parallel.exact_elastic derives train.grad_accum (global_batch / batch_size / world size), "
                        f"but the config sets it to {cfg.train.grad_accum}: unset it (--set train.grad_accum=null)")
    if target % batch_size:
        raise UserError(f"parallel.exact_elastic: train.global_batch = {target} is not a whole number of micro-batches "
                        f"of data.batch_size = {batch_size}; make it a multiple of {batch_size}")
    micro_batches = target // batch_size
    exact = exact_world_sizes(micro_batches)
    if world_size not in exact:
        raise UserError(f"parallel.exact_elastic: world size {world_size} is not exact for {micro_batches} "
                        f"micro-batches per step (each rank's block must be a subtree of the summation tree); "
                        f"the exact world sizes are {_listed(exact)}: run at one of those")
    return batch_size, micro_batches // world_size


def exact_world_sizes(micro_batches: int) -> list[int]:
    """The world sizes at which `parallel.exact_elastic` is exact for V = `micro_batches`: 1 (one
    rank sums the whole tree), and every W dividing V whose block V / W is a power of two (a block
    is then one aligned subtree of the binary-counter tree, harness/parallel/exact.py)."""
    return [w for w in range(1, micro_batches + 1)
            if w == 1 or (micro_batches % w == 0 and (micro_batches // w) & (micro_batches // w - 1) == 0)]


def valid_world_sizes(cfg: RunConfig) -> list[int]:
    """Every world size `batch_shape` accepts for `cfg` (with `train.global_batch` set: the
    divisors of the global batch that leave an integer micro-batch x accumulation split)."""
    target = cfg.train.global_batch
    if target is None:
        return []  # any world size: the global batch grows with it
    divisors = {w for d in range(1, math.isqrt(target) + 1) if target % d == 0 for w in (d, target // d)}
    return sorted(w for w in divisors if _split_exists(cfg, target, w))


def _split_exists(cfg: RunConfig, target: int, world: int) -> bool:
    """Whether global_batch = batch_size x grad_accum x `world` has an integer solution with the
    factors the config sets held fixed (as `batch_shape` derives the other)."""
    accum_set = "grad_accum" in cfg.train.model_fields_set
    batch_set = "batch_size" in cfg.data.model_fields_set
    per_rank = target // world
    if not accum_set:
        return per_rank % cfg.data.batch_size == 0
    if not batch_set:
        return per_rank % cfg.train.grad_accum == 0
    return per_rank == cfg.data.batch_size * cfg.train.grad_accum


def _listed(sizes: list[int], most: int = 12) -> str:
    shown = ", ".join(map(str, sizes[:most]))
    return shown if len(sizes) <= most else f"{shown}, ... ({len(sizes)} sizes)"


def math_fields(cfg: RunConfig) -> dict[str, Any]:
    """Flatten the config to dotted keys, leaving out FREE_FIELDS: what a resume must keep."""
    tree = cfg.model_dump(mode="json")
    tree["model"]["args"] = model_args(cfg)
    flat = flatten(tree)
    return {k: v for k, v in flat.items() if not is_free(k)}


def is_free(key: str) -> bool:
    """Whether dotted config `key` is (inside) one of FREE_FIELDS: it does not change the numbers."""
    return any(key == f or key.startswith(f + ".") for f in FREE_FIELDS)


# Math keys added after runs existed whose default is not what those runs did: a saved config
# without the key ran with this value (the reference's AdamW decayed every parameter).
ADDED_MATH_KEYS = {"optim.decay_1d": True, "optim.decay_embeddings": True}


def config_changes(saved: dict[str, Any], current: RunConfig) -> dict[str, tuple[Any, Any]]:
    """Math key -> (saved value, current value) for every key that differs, sorted by key."""
    saved = copy.deepcopy(saved)
    for dotted, value in ADDED_MATH_KEYS.items():
        *parents, leaf = dotted.split(".")
        node = saved
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.setdefault(leaf, value)
    before = math_fields(RunConfig.model_validate(saved))
    after = math_fields(current)
    return {k: (before.get(k), after.get(k)) for k in sorted(before.keys() | after.keys())
            if before.get(k) != after.get(k)}


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML file (following `extends` and `unset`), apply `--set` overrides, validate
    (harness/config_layers.py)."""
    layers = read_layers(Path(path), overrides)
    try:
        return RunConfig.model_validate(layers.raw)
    except ValidationError as e:
        raise UserError(_describe(e, layers)) from None


def _describe(e: ValidationError, layers: Layers) -> str:
    """`SOURCE: key: message` per key, joined with '; ': SOURCE is the file that set the key (an
    inherited key: the base file), or "command line" for a key an override (`--set`, a sweep's
    `--grid`) gave. The members of a union field (`every_steps`: an integer or "auto") fail as
    one key, their messages joined with "or"; an unknown optimizer type is `optim.type`'s."""
    problems: dict[str, list[str]] = {}
    for err in e.errors():
        loc = [x for x in err["loc"] if not (isinstance(x, str) and x in _UNION_TAGS)]
        if len(loc) > 1 and isinstance(loc[-1], str) and not loc[-1].isidentifier():
            loc = loc[:-1]  # pydantic names the union member it tried: constrained-int, literal['auto']
        if err["type"] == "union_tag_invalid":
            loc.append("type")  # the discriminator (optim/config.py: _arm), where the bad value was given
        key = ".".join(str(x) for x in loc)
        template = _MESSAGES.get(err["type"])
        msg = template.format(**err.get("ctx", {}), input=err.get("input")) if template else err["msg"]
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 3 and err["loc"][0] == "optim":
            msg = _optim_key_elsewhere(str(err["loc"][1]), str(err["loc"][2])) or msg
        problems.setdefault(key, []).append(msg)
    parts = []
    for key, messages in problems.items():
        source = layers.source(key)
        parts.append(f"{source}: {key}: {' or '.join(messages)}" if key else f"{source}: {' or '.join(messages)}")
    return "; ".join(parts)


_MESSAGES = {
    "extra_forbidden": "unknown key (check the spelling; see configs/ for the valid keys)",
    "union_tag_invalid": "unknown type {tag!r}; expected one of {expected_tags}",
}


def _optim_key_elsewhere(arm: str, key: str) -> str | None:
    """For an unknown key that another optimizer type has: which types take it (else None)."""
    takers = arms_taking(key)
    if not takers:
        return None
    return (f"unknown key for optim.type = {arm!r}; it belongs to optim.type = "
            f"{' or '.join(repr(t) for t in takers)}: remove it or change optim.type")


# Discriminated-union members appear in pydantic's error locations; users never write them.
_UNION_TAGS = set(ARMS)
