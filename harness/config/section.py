"""Section: the base of every config section. Unknown keys are refused (`extra="forbid"`), and an
assignment is validated as a file's value is, so no section holds a value its file could not."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
