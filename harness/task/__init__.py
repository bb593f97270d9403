"""Training tasks: what a run trains (models, data, optimizers, the loss or a whole step, eval,
extra state), behind one interface the production loop and `harness.testing` share (docs/tasks.md).

The face for users: `TaskContext` (what a task's builders get), `StepInfo` (where a micro-batch
lies), `StepLoss` (what a whole step returns). The harness's: `load_task(cfg)` -> `BoundTask`.
The rooms: contract.py (the contract and its types), bound.py (a task checked, its optional
methods filled in), data.py (its sources as the trainer reads them), language_model.py (the
built-in task), loading.py (`task.factory` or the built-in).
"""

from harness.task.bound import BoundTask
from harness.task.contract import StepInfo, StepLoss, TaskContext
from harness.task.loading import load_task, task_context

__all__ = ["BoundTask", "StepInfo", "StepLoss", "TaskContext", "load_task", "task_context"]
