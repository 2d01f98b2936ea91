"""The one strict Pydantic base every miles_ray config derives from, and the one way to build a variant field.

``extra="forbid"`` turns a misspelled field into an error that names it, and ``validate_assignment``
keeps a config valid after it is edited in a notebook. Configs are plain data: actor handles and other
runtime objects are constructor arguments, never fields.

Variants (engines, trainer backends, losses, advantage estimators) are ``kind_union`` fields: a discriminated
union on ``kind``, where a dict may leave ``kind`` out when the field has a default variant, and errors keep the
plain path of the field (``engine.num_threads``, not ``engine.embedded.num_threads``).

Usage::

    class TrainerGroupConfig(StrictConfig):
        loss: kind_union(PPOClipLossConfig, GSPOLossConfig) = Field(default_factory=PPOClipLossConfig, ...)
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo


class StrictConfig(BaseModel):
    """Base class for all configs: unknown fields are rejected, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def kind_union(*variants: type[StrictConfig], default: str | None = None) -> Any:
    """The annotation of a field holding one of ``variants``, chosen by their ``kind`` literal.

    Args:
        variants: config classes, each with a ``kind: Literal["..."] = "..."`` field.
        default: the ``kind`` a dict without one gets; None makes ``kind`` required in dicts.

    Raises:
        ValueError: at validation, for an unknown ``kind`` (the error lists the known ones).

    """
    by_kind = {v.model_fields["kind"].default: v for v in variants}

    def select(value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, dict):
            return value
        kind = value.get("kind", default)
        if kind not in by_kind:
            raise ValueError(f"{info.field_name}.kind must be one of {sorted(by_kind)}, got {kind!r}")
        # validated here, not by the union, so that an error's path is the field's own (no kind segment)
        return by_kind[kind].model_validate(value)

    return Annotated[Union[variants], BeforeValidator(select), Field(discriminator="kind")]  # noqa: UP007
