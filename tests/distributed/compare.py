"""Two runs compared bit for bit across world sizes (exact elastic mode): their logged losses and
their checkpoints of one step."""

from __future__ import annotations

import json
from pathlib import Path

from harness.checkpoint import CheckpointStore
from harness.checkpoint.diff import compare_checkpoints


def losses_of(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def bitwise_differences(a: Path, b: Path, step: int) -> list[str]:
    """What differs between the two runs' checkpoints of `step` (model and optimizer compared
    whole where FSDP sharded them), besides the files of a rank one run did not have (rank 1's
    data cursor and streams; rank 0's are compared) and the fingerprints' hashes of the model and
    optimizer, which under FSDP cover rank 0's shard, not the whole (docs/distributed.md)."""
    store_a, store_b = CheckpointStore(str(a)), CheckpointStore(str(b))
    diff = compare_checkpoints((store_a, store_a.ref(step)), (store_b, store_b.ref(step)))
    return [d.line for d in diff.differences if not d.part.startswith("rank-") and not _shard_hash(d.where)]


def _shard_hash(where: str) -> bool:
    return where.startswith("parts/fingerprints/") and "state_hash" in where and where.rsplit("/", 1)[-1] in (
        "model", "optim")
