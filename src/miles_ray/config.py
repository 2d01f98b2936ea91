"""The one strict Pydantic base every miles_ray config derives from.

``extra="forbid"`` turns a misspelled field into an error that names it, and ``validate_assignment``
keeps a config valid after it is edited in a notebook. Configs are plain data: actor handles and other
runtime objects are constructor arguments, never fields.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictConfig(BaseModel):
    """Base class for all configs: unknown fields are rejected, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
