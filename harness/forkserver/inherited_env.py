"""Which environment a fork server can honour: the variables read before a child's first line runs.

A forked child inherits what its server's interpreter and libraries made of the environment when
they started and were imported: the OpenMP runtime's thread settings (libgomp reads OMP_* when it
loads), oneMKL's CNR mode, sys.path (PYTHONPATH), stdio encodings (locale, PYTHONIOENCODING), the
str hash seed (PYTHONHASHSEED), the temp folder tempfile computed at import (TMPDIR). A child
whose environment gives any of these another value than the server's would run with the server's
instead, so it is refused (the client starts a fresh interpreter). Everything else (HARNESS_*,
AWS_*, RANK, a test's own switches) is read when the program runs, after the child's environment
is in place, and may differ freely.

Contract: `signature(env)` is the part of `env` that must equal the server's, after
`numerics.prepare_environment`'s defaults, which a fresh `harness` process would add before
torch loads too. A variable that a preloaded module reads at import belongs in `SENSITIVE`.
"""

from __future__ import annotations

from collections.abc import Mapping

from harness.repro import numerics

# Prefixes (and whole names) of variables read at interpreter start or at import of torch, its
# math libraries, numpy, tokenizers or transformers: a difference in one of them is refused.
SENSITIVE = (
    "PYTHON", "LD_", "LC_", "LANG", "LANGUAGE", "TMPDIR", "TEMP", "TMP", "HOME",
    "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "BLIS_", "DNNL_", "ONEDNN_", "MKLDNN_", "NPY_", "NUMPY_",
    "TORCH", "PYTORCH_", "CUDA_", "CUBLAS_", "CUDNN_", "NVIDIA_", "NCCL_", "TRITON_", "KINETO_",
    "HF_", "TRANSFORMERS_", "TOKENIZERS_", "MALLOC_", "GLIBC_",
)

# Set for torchrun and by it: what it puts in its workers' environment, what its agent reads
# (TORCH_DISABLE_SHARE_RDZV_TCP_STORE) and the NCCL process group's settings (TORCH_NCCL_*, which
# ops/torchrun/train.sh exports), all read when a process group, a rendezvous or torchrun's error
# reporting is set up, never at import. A relayed worker (relay.py) may differ from its server there.
LAUNCHER = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def sensitive(name: str) -> bool:
    return name.startswith(SENSITIVE) and not name.startswith(LAUNCHER)


def signature(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` (with the numerics defaults a fresh `harness` process adds) that a
    fork server must have been started with to serve a child with this environment."""
    prepared = {**numerics.REPRODUCIBLE_ENV, **env}
    return {name: value for name, value in sorted(prepared.items()) if sensitive(name)}
