"""A checkpoint-robust long-run training harness for PyTorch.

Runs can be interrupted anywhere and resumed bit for bit; checkpoints are safetensors + JSON,
committed atomically on any fsspec store. See docs/architecture.md for the map.
"""

__version__ = "0.1.0"
