"""Section: the base of every config section. Unknown keys are refused (`extra="forbid"`), and an
assignment is validated as a file's value is, so no section holds a value its file could not.
CodeSection: a section that names user code by import path (`factory`), and where to find it.
dumped_default: a field's default as the config's JSON dump holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, TypeAdapter
from pydantic.fields import FieldInfo


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CodeSection(Section):
    """A section whose `factory` names user code ("package.module:function"). `code_folder` is
    the folder of the config file that named it (a factory given with --set: the config file
    named on the command line), set by load_config; the factory's module is looked for there
    after sys.path (harness/models: load_factory), so a module beside its config needs no
    PYTHONPATH. None (a section not read from a file): sys.path only. Not a key: where the file
    lies is no part of the run's config."""

    _code_folder: Path | None = PrivateAttr(None)

    @property
    def code_folder(self) -> Path | None:
        return self._code_folder

    def set_code_folder(self, folder: Path) -> None:
        self._code_folder = folder


def dumped_default(field: FieldInfo) -> Any:
    """`field`'s default (of a field that has one) as model_dump(mode="json") writes it."""
    assert field.annotation is not None  # every config field is annotated
    return TypeAdapter(field.annotation).dump_python(field.get_default(call_default_factory=True), mode="json")
