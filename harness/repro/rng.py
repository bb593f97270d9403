"""Capture and restore every random number generator a training step can draw from.

`RNGState(device)` is a Stateful part (registered as `rng`, saved per rank): python's `random`,
numpy's global generator (when numpy is importable), the torch CPU generator and, when the process
trains on a GPU, the generator of that GPU (`device`, the rank's own). Restoring all of them at a
step boundary replays the same dropout masks and any user-side randomness. Its state dict holds
only JSON values and uint8 tensors:

    {"python": {"version": int, "state": [int, ...], "gauss_next": float | None},
     "numpy":  {"bit_generator": str, "key": [int, ...], "pos": int,
                "has_gauss": int, "cached_gaussian": float},             (only with numpy)
     "torch":  uint8 tensor,
     "cuda":   uint8 tensor}                              (only when training on a GPU)

The GPU stream belongs to the rank, not to a device index: it is restored onto whatever device
the rank trains on after a restart (another local index, another CUDA_VISIBLE_DEVICES mapping,
another number of visible GPUs). A checkpoint without one (written on a CPU) loads anywhere; a
GPU stream loaded by a process training on the CPU is not used (nothing there draws from it). A
harness before this one saved every visible GPU's generator as a list; from such a state the
entry of this rank's device index is restored, which is what that harness restored there.

`micro_batch_streams(seed, step, device)` is the exact-elastic mode's randomness: inside it every
generator above is seeded from (seed, step, micro-batch v) alone, and the process's own streams
are put back when it ends.

Loading raises UserError when the state lacks a stream every process has, or needs numpy and
numpy is missing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from harness.errors import UserError
from harness.repro.splitmix import derive_seed

np: ModuleType | None
try:
    import numpy as np
except ImportError:  # numpy is optional for users' own setups; without it there is no state to keep
    np = None


def seed_everything(seed: int) -> None:
    """Seed python, numpy (when importable), torch CPU and every CUDA device from one integer.
    The torch generators are seeded one by one, as `torch.manual_seed` seeds those two (the same
    states), without its look at every other device type (0.12 ms a call: exact elastic mode
    seeds at every micro-batch); the harness trains on CPU or CUDA only (`train.device`)."""
    random.seed(seed)
    if np is not None:
        # numpy accepts only seeds in [0, 2**32).
        np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# derive_seed's first part for the micro-batch streams: apart from every other use of the run seed.
_MICRO_BATCH_DOMAIN = 0x4D494352  # "MICR"


@contextmanager
def micro_batch_streams(seed: int, step: int, device: torch.device) -> Iterator[Callable[[int], None]]:
    """Within the block, `use(v)` makes every generator draw from (seed, step, v) only: the same
    dropout masks for canonical micro-batch `v` of `step` whichever rank computes it, whatever was
    drawn before in the block. The process's own streams (python, numpy, torch CPU, and `device`'s
    when it is a GPU: the one the step draws from) are saved on entry and restored on exit: once
    for a step's micro-batches, since nothing between them draws (around each, numpy's state alone
    cost 0.12 ms a micro-batch)."""
    saved_python = random.getstate()
    saved_numpy = np.random.get_state() if np is not None else None
    saved_torch = torch.get_rng_state()
    saved_cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield lambda micro_batch: seed_everything(derive_seed(_MICRO_BATCH_DOMAIN, seed, step, micro_batch))
    finally:
        random.setstate(saved_python)
        if np is not None and saved_numpy is not None:  # saved when numpy is there
            np.random.set_state(saved_numpy)
        torch.set_rng_state(saved_torch)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda, device)


class RNGState:
    """The process's generators as one Stateful part; see the module docstring for the layout.
    `device`: where the process trains (a GPU's generator is saved and restored only for it)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def state_dict(self) -> dict[str, Any]:
        version, state, gauss_next = random.getstate()
        parts: dict[str, Any] = {
            "python": {"version": version, "state": list(state), "gauss_next": gauss_next},
            "torch": torch.get_rng_state(),
        }
        if np is not None:
            bit_generator, key, pos, has_gauss, cached_gaussian = np.random.get_state()
            parts["numpy"] = {
                "bit_generator": bit_generator,
                "key": key.tolist(),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            }
        if self.device.type == "cuda":
            parts["cuda"] = torch.cuda.get_rng_state(self.device)
        return parts

    def restore_template(self) -> dict[str, Any]:
        """What a checkpoint's `rng` part is matched against (checkpoint/into_live.py): the state
        without the GPU stream, which a checkpoint may hold or not whatever this process trains on
        (`load_state_dict` takes it where there is one)."""
        return {k: v for k, v in self.state_dict().items() if k != "cuda"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"python", "torch"} - state.keys()
        if missing:
            raise UserError(
                f"RNG state lacks {sorted(missing)}: the checkpoint is incomplete; resume from another one"
            )
        if "numpy" in state and np is None:
            raise UserError("the checkpoint holds numpy's RNG state but numpy is not installed: pip install numpy")

        python = state["python"]
        # JSON brings the state back as a list; random.setstate insists on a tuple.
        random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))
        if "numpy" in state:
            assert np is not None  # refused above without numpy
            saved = state["numpy"]
            np.random.set_state(
                (
                    saved["bit_generator"],
                    np.asarray(saved["key"], dtype=np.uint32),
                    saved["pos"],
                    saved["has_gauss"],
                    saved["cached_gaussian"],
                )
            )
        torch.set_rng_state(_byte_tensor(state["torch"]))
        own = self._own_stream(state.get("cuda"))
        if own is not None:
            torch.cuda.set_rng_state(_byte_tensor(own), self.device)

    def _own_stream(self, saved: torch.Tensor | list[torch.Tensor] | None) -> torch.Tensor | None:
        """The saved GPU stream this process restores onto its device: None when it trains on the
        CPU or nothing was saved; from an older harness's list (every visible GPU's), the entry of
        this device's index (the one that harness restored onto it), refused where there is none."""
        if saved is None or self.device.type != "cuda":
            return None
        if not isinstance(saved, list):
            return saved
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if index >= len(saved):
            raise UserError(f"the checkpoint holds the RNG states of {len(saved)} CUDA devices (written by an older "
                            f"harness, one per visible GPU) and this rank trains on cuda:{index}: resume with "
                            "the visible GPUs (CUDA_VISIBLE_DEVICES) of the saving run")
        return saved[index]


def _byte_tensor(saved: torch.Tensor) -> torch.Tensor:
    # A loaded checkpoint may hand back a view or a tensor on another device; the setters want
    # a contiguous CPU uint8 tensor.
    return saved.to(device="cpu", dtype=torch.uint8).contiguous()
