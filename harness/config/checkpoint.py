"""[checkpoint] and [checkpoint.local]: when and where checkpoints are written (cadence, background
saves, retention, preemption, the lease) and the local tier. None of these keys changes the math."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from harness.config.section import Section


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
            "64; unset: as large as the state, up to half the memory the host has available, shared by its ranks; "
            "pinned for a GPU's state). With less than the state the step loop waits at a save until the writer has "
            "drained all but this much (harness/checkpoint/save/staging_ring.py)."
        ),
    )
    writer_cores: Literal["auto", "any"] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] = Field(
        "auto",
        description=(
            "The cores background checkpoint work (the persist, the local tier's peer copies, local-first uploads) "
            "runs on (harness/checkpoint/save/writer_cores.py): \"auto\" = the cores this node's training threads "
            "(train.cpu_threads x ranks per node) leave free, those taking the disk's interrupts first, and any core "
            "when none is free; \"any\" = wherever the OS puts it; or a list of core numbers. The steps beside a "
            "save slow down less when the writer keeps off the training thread's core."
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

