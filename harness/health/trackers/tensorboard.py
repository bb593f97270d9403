"""TensorBoard: scalars of every step in `LOG_DIR/tensorboard`, continuing the same curves after restarts.

Each process opens a `SummaryWriter(purge_step=resumed_step + 1)`: TensorBoard then drops the
points at and after that step that an earlier process wrote (the steps a crash re-runs), so
every step is shown once. A rollback re-opens the writer the same way (`rewind`). Each write is
flushed: a point that sits in the writer's queue when the process is killed would be lost for
good if its step is before the checkpoint the run resumes from.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.health.trackers.packages import require
from harness.health.trackers.scalars import scalars

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

SUBDIR = "tensorboard"


class TensorBoardTracker:
    def __init__(self, log_dir: Path, resumed_step: int) -> None:
        require("tensorboard", "tensorboard", "tensorboard")
        self.dir = Path(log_dir) / SUBDIR
        self.writer: SummaryWriter | None = None
        self.rewind(resumed_step)

    def rewind(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self.writer is not None:
            self.writer.close()
        self.writer = SummaryWriter(str(self.dir), purge_step=step + 1)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        assert self.writer is not None  # opened by __init__ (rewind)
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        assert self.writer is not None  # opened by __init__ (rewind)
        self.writer.close()
