"""`optim` is the lower layer: it imports nothing from `harness` (which imports it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Every module of optim, imported with `harness` made unimportable (None in sys.modules makes any
# `import harness...` raise ImportError).
PROBE = """
import importlib, pkgutil, sys
sys.modules["harness"] = None
import optim
for module in pkgutil.iter_modules(optim.__path__):
    importlib.import_module(f"optim.{module.name}")
print("ok", len(sys.modules))
"""


def test_every_optim_module_imports_without_harness():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-2000:]
