"""Models: the built-in GPT and the resolver for users' own model factories (and the built-in
factory for transformers causal LMs, `harness.models.hf:causal_lm`, imported only when named).

A model factory is a callable `factory(args: dict) -> nn.Module`, named in the config by an
import path "package.module:attribute" (the attribute may be dotted, e.g. "mod:Class.build"),
looked for on sys.path and then beside the config file that named it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.config import DEFAULT_FACTORY
from harness.errors import UserError
from harness.log import get_logger
from harness.models.gpt import GPT, GPTConfig, build_gpt

__all__ = ["DEFAULT_FACTORY", "GPT", "GPTConfig", "build_gpt", "call_factory", "load_factory"]

log = get_logger(__name__)


def call_factory(factory: Callable[[dict[str, Any]], Any], path: str, kind: str, setting: str,
                 args: dict[str, Any], call_args: dict[str, Any]) -> Any:
    """`factory(call_args)`. Its UserError passes through; any other exception (a wrong signature,
    bad `args`) becomes a one-line UserError naming the factory at `path`, the `setting` its
    `args` came from and the exception; the traceback goes to the debug log."""
    try:
        return factory(call_args)
    except UserError:
        raise
    except Exception as e:
        log.debug(f"the {kind} raised", factory=path, exc_info=True)
        raise UserError(f"{kind} {path!r} failed with {kind.split()[0]} args {args}: {type(e).__name__}: {e}; fix "
                        f"{setting} (or the factory, which takes one dict; --log-level debug shows the "
                        "traceback)") from None


def load_factory(path: str, kind: str = "model factory", example: str = DEFAULT_FACTORY,
                 folder: Path | None = None) -> Callable[..., Any]:
    """Import and return the callable at "package.module:attribute". `folder` (the folder of the
    config file that named it, CodeSection.code_folder) is added to the end of sys.path first,
    and stays there (the module may import its neighbours later; loader workers fork with it):
    a module beside its config is found without PYTHONPATH, and an installed module of the same
    name still wins. Raises UserError saying which part of the path is wrong; `kind` and
    `example` name the setting in the message."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise UserError(
            f"{kind} {path!r} is not of the form 'package.module:function' (e.g. {example!r})"
        )
    if folder is not None and str(folder) not in sys.path:
        sys.path.append(str(folder))
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as e:
        beside = f"beside the config file (in {folder}), " if folder is not None else ""
        raise UserError(
            f"{kind} {path!r}: cannot import module {module_name!r} ({e}); "
            f"check the spelling and that the module is {beside}installed or on PYTHONPATH"
        ) from e
    for name in attribute.split("."):
        try:
            target = getattr(target, name)
        except AttributeError as e:
            raise UserError(f"{kind} {path!r}: {module_name!r} has no attribute {attribute!r}") from e
    if not callable(target):
        raise UserError(f"{kind} {path!r} is a {type(target).__name__}, not a callable")
    return target
