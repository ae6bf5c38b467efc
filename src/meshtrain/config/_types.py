"""Value types shared by every config section.

Numbers are validated strictly (``true`` is not a number, ``"eight"`` is not an integer) with
two deliberate leniencies, both because real DeepSpeed configs need them:

* an integral float is an integer: JSON has no ``5e8`` integer literal, so DeepSpeed configs
  write bucket sizes as ``5e8`` (a float) for integer fields;
* a numeric string is a number: YAML 1.1 (PyYAML) reads ``5e8`` as the *string* "5e8".

``"auto"`` (the transformers DeepSpeed integration's placeholder) is a separate ``Literal``
member of the fields that accept it, never a silent default.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PrivateAttr,
    Strict,
    ValidationError,
)

AUTO = "auto"
Auto = Literal["auto"]


def _number_from_string(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() != AUTO:
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return value


def _to_int(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean is not an integer")
    value = _number_from_string(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def _to_float(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    value = _number_from_string(value)
    if isinstance(value, int):
        return float(value)
    return value


def _int(*constraints: Any) -> Any:
    return Annotated[(int, Strict(), *constraints, BeforeValidator(_to_int))]


def _float(*constraints: Any) -> Any:
    return Annotated[
        (float, Strict(), AllowInfNan(False), *constraints, BeforeValidator(_to_float))
    ]


Int = _int()
NonNegInt = _int(Ge(0))
PosInt = _int(Gt(0))
Float = _float()
NonNegFloat = _float(Ge(0))
PosFloat = _float(Gt(0))
UnitFloat = _float(Ge(0), Le(1))
Beta = _float(Ge(0), Lt(1))
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


def int_choice(*choices: int) -> Any:
    """A ``Literal`` of integers that also accepts ``2.0`` for ``2`` but never ``true``."""
    return Annotated[Literal[choices], BeforeValidator(_to_int)]  # type: ignore[valid-type]


def canonical_choice(choices: tuple[str, ...]) -> Any:
    """A ``Literal`` of strings matched case-insensitively and stored in canonical spelling."""
    lookup = {c.lower(): c for c in choices}

    def canon(value: Any) -> Any:
        return lookup.get(value.lower(), value) if isinstance(value, str) else value

    return Annotated[Literal[choices], BeforeValidator(canon)]  # type: ignore[valid-type]


def label_paths(model: BaseModel, prefix: str = "") -> None:
    """Tell every section below ``model`` its dotted path (``zero_optimization.offload_param``),
    so an assignment error names it. Instance state, set by the root config's validator:
    no registry of classes to fill from other modules."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, Section):
            value._path = f"{prefix}{name}"
            label_paths(value, f"{prefix}{name}.")


class Section(BaseModel):
    """Base of every config model: unknown keys are errors, every field is documented.

    Assignments are validated too, and a bad one raises ConfigError naming the path.
    """

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )

    _path: str = PrivateAttr(default="")  # dotted place in the config, for error messages

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            from meshtrain.config._errors import translate

            raise translate(exc, type(self), self._path, {name: value}) from None
