"""Training tasks: what a run trains (models, data, optimizers, the loss or a whole step, eval,
extra state), behind one interface the production loop and `harness.testing` share (docs/tasks.md).

The face for users: `TaskContext` (what a task's builders get), `StepInfo` (where a micro-batch
lies), `StepLoss` (what a whole step returns), `SeededSamples` (synthetic samples, each drawn
from its own seeded generator). The harness's: `load_task(cfg)` -> `BoundTask`.
The rooms: contract.py (the contract and its types), bound.py (a task checked, its optional
methods filled in), data.py (its sources as the trainer reads them), language_model.py (the
built-in task), loading.py (`task.factory` or the built-in), samples.py (SeededSamples).
"""

from harness.task.bound import BoundTask
from harness.task.contract import StepInfo, StepLoss, TaskContext
from harness.task.loading import load_task, task_context
from harness.task.samples import SeededSamples

__all__ = ["BoundTask", "SeededSamples", "StepInfo", "StepLoss", "TaskContext", "load_task", "task_context"]
