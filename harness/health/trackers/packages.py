"""The optional package a tracker needs, imported when the tracker is opened."""

from __future__ import annotations

from typing import Any

from harness.errors import UserError


def require(module: str, extra: str, tracker: str) -> Any:
    """Import `module` for `tracker`, or a UserError naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"log.trackers = [\"{tracker}\"] needs the {module.split('.')[0]} package: "
                        f"pip install 'harness[{extra}]', or remove it from log.trackers") from None
