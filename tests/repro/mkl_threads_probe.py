"""Run in a fresh interpreter by test_numerics.py: train the quickstart model two steps with MKL
on 2 threads and again with MKL on 1 thread (torch's own kernels on 2 throughout), as oneMKL's
dynamic threading may do on a busy machine; print the settings and both runs' numbers as JSON."""

import ctypes
import hashlib
import json
import sys
from pathlib import Path

from harness.repro import numerics

settings = numerics.apply(2)  # first: MKL's mode is fixed at its first computation

import torch  # noqa: E402

from harness.config import load_config  # noqa: E402
from harness.run.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run(mkl_threads: int) -> dict:
    trainer = Trainer(load_config(ROOT / "configs" / "quickstart.toml", ["train.cpu_threads=2"]))
    numerics._mkl().MKL_Set_Num_Threads_Local(mkl_threads)  # after the trainer fixed torch's count (and MKL's)
    losses = [trainer.train_step().loss for _ in range(2)]
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in trainer.model.parameters()))
    return {"losses": losses, "params": digest.hexdigest(), "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    if numerics._mkl() is None:
        print(json.dumps({"settings": settings}))
        sys.exit(0)
    fn = numerics._mkl().MKL_Set_Num_Threads_Local
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    print(json.dumps({"settings": settings, "mkl2": run(2), "mkl1": run(1)}))
