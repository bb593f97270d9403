"""[train]: the step loop: steps, seed, accumulation, precision, evaluation and logging cadence,
the resume fingerprints and what an anomaly does."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from harness.config.section import Section


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
    host_heap: Literal["keep", "system"] = Field(
        "keep",
        description=(
            "keep = the host memory the process frees stays in it for its next allocations (glibc: no block "
            "mapped on its own, the heap never cut back), so a step does not fault in again the gradients and "
            "optimizer temporaries the step before it freed; the RSS stays at its peak. system = the C library's "
            "defaults (freed memory goes back to the kernel). harness/process/host_heap.py"
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
            "(metrics.jsonl `state_hash`; 0 = only at checkpoints). Costs an xxh3 pass over the state (and a copy "
            "to the CPU of the tensors on a GPU). The loss and batch hash are recorded every step regardless."
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

