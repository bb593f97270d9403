"""Shared test setup: CPU determinism (one thread, deterministic algorithms) for every test."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
