"""The environment a checkpoint recorded against the one resuming it (harness/run/environment.py):
on a GPU the model, the CUDA, cuDNN and NCCL versions and the CUDA numerical settings change the
bits, and a resume under others warns, key by key, as for the torch version."""

from __future__ import annotations

import copy

import torch
from structlog.testing import capture_logs

from harness.run import environment


def gpu_fingerprint() -> dict:
    """What a run on an H100 records (environment_fingerprint on CUDA)."""
    fp = environment.environment_fingerprint(torch.device("cpu"))
    fp.update(device_type="cuda", cuda="12.8", gpu="NVIDIA H100 80GB HBM3", cudnn=91000, nccl="2.27.3")
    fp["numerics"]["cuda"] = {"matmul_allow_tf32": False, "cudnn_allow_tf32": True, "cudnn_benchmark": False,
                              "sdpa_backends": {"flash": True, "math": True}, "nccl": {"NCCL_ALGO": None}}
    fp["numerics"]["env"]["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return fp


def warned(before: dict, now: dict, monkeypatch) -> dict[str, tuple]:
    """key -> (checkpoint, now) of each warning `warn_if_changed` gives resuming `before` under `now`."""
    monkeypatch.setattr(environment, "environment_fingerprint", lambda device: now)
    with capture_logs() as logs:
        environment.warn_if_changed(before, torch.device("cuda"))
    return {log["key"]: (log["checkpoint"], log["now"]) for log in logs if log["log_level"] == "warning"}


def test_another_gpu_model_cuda_cudnn_nccl_or_cuda_setting_warns_each(monkeypatch):
    before = gpu_fingerprint()
    now = copy.deepcopy(before)
    now.update(gpu="NVIDIA A100-SXM4-80GB", cuda="12.9", cudnn=91100, nccl="2.28.1")
    now["numerics"]["cuda"]["matmul_allow_tf32"] = True
    now["numerics"]["cuda"]["sdpa_backends"] = {"flash": False, "math": True}
    now["numerics"]["env"]["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    assert warned(before, now, monkeypatch) == {
        "gpu": ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"), "cuda": ("12.8", "12.9"),
        "cudnn": (91000, 91100), "nccl": ("2.27.3", "2.28.1"),
        "numerics.cuda.matmul_allow_tf32": (False, True),
        "numerics.cuda.sdpa_backends": ({"flash": True, "math": True}, {"flash": False, "math": True}),
        "numerics.cuda.CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),
    }


def test_the_same_gpu_environment_is_silent_and_the_cpu_keys_still_count(monkeypatch):
    before = gpu_fingerprint()
    assert warned(before, copy.deepcopy(before), monkeypatch) == {}
    now = copy.deepcopy(before)
    now["numerics"]["cpu_threads"] = before["numerics"]["cpu_threads"] + 1
    assert list(warned(before, now, monkeypatch)) == ["numerics.cpu_threads"]


def test_a_cpu_checkpoint_resumed_on_a_gpu_names_the_device_type_only(monkeypatch):
    """A checkpoint of a CPU run has no GPU keys: the device type's change is the warning, not a
    list of keys the checkpoint never had."""
    now = gpu_fingerprint()
    before = environment.environment_fingerprint(torch.device("cpu"))
    before["numerics"]["env"]["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    assert warned(before, now, monkeypatch) == {"device_type": ("cpu", "cuda")}
