"""The run config: typed pydantic models loaded from TOML, overridden with `--set key=value`.

Contract:
- Every section forbids unknown keys; a mistake is a `UserError` naming the key and where it was
  set: the file (for an inherited key, the file it came from) or "command line".
- Files, `extends`, `unset` and `--set` (`null` unsets a key) are layered by
  harness/config_layers.py; this package validates the result.
- `math_fields()` lists the keys that decide the numbers a run produces. Resuming with any of them
  changed is refused unless explicitly allowed; everything else (logging, checkpoint cadence,
  retention, eval cadence, worker count) may change between restarts.
- Reading a config imports no torch (nor does optim/config.py): a config mistake is reported
  before torch loads.

This is the face: every name the rest of the harness uses comes from here. The rooms: section.py
(the base), task.py, model.py, data.py, train.py, checkpoint.py (with the local tier), parallel.py,
monitoring.py (health, log, debug), run.py (RunConfig, the root; [optim] is optim/config.py's),
loading.py (load_config), batch.py (the batch shape), math_keys.py (math vs free keys),
public.py (the redacted config). A room imports other rooms, never this face.
"""

from harness.config.batch import batch_shape, exact_shape, exact_world_sizes, valid_world_sizes
from harness.config.checkpoint import CheckpointSection, LocalTierSection
from harness.config.data import DataSection, DataSource
from harness.config.loading import load_config
from harness.config.math_keys import ADDED_OPTIM_KEYS, FREE_FIELDS, config_changes, is_free, math_fields
from harness.config.model import DEFAULT_FACTORY, ModelSection
from harness.config.monitoring import DebugSection, HealthSection, LogSection
from harness.config.parallel import ParallelSection
from harness.config.public import SECRET_KEYS, public_config
from harness.config.run import RunConfig, model_args
from harness.config.section import Section
from harness.config.task import TaskSection
from harness.config.train import TrainSection

# Re-exported for the callers that flatten a config the way the math check does.
from harness.config_layers import flatten

__all__ = [
    "ADDED_OPTIM_KEYS", "DEFAULT_FACTORY", "FREE_FIELDS", "SECRET_KEYS",
    "CheckpointSection", "DataSection", "DataSource", "DebugSection", "HealthSection", "LocalTierSection",
    "LogSection", "ModelSection", "ParallelSection", "RunConfig", "Section", "TaskSection", "TrainSection",
    "batch_shape", "config_changes", "exact_shape", "exact_world_sizes", "flatten", "is_free", "load_config",
    "math_fields", "model_args", "public_config", "valid_world_sizes",
]
