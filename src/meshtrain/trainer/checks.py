"""Value checks of ``TrainingArguments``: each raises one ConfigError naming the argument,
the value and the fix (transformers would raise a bare TypeError, or accept the string
"false" as True)."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtrain.errors import ConfigError


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    text = getattr(value, "value", value)  # transformers' enums carry .value
    if not isinstance(text, str) or text.lower() not in allowed:
        raise ConfigError(
            f"TrainingArguments.{name}: {value!r} is not allowed; use one of "
            f"{', '.join(repr(a) for a in allowed)}"
        )
    return text.lower()


def positive(name: str, value: Any, *, allow_zero: bool = False, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        want = "an integer" if integer else "a number"
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"TrainingArguments.{name}: {value!r} is not allowed; use {want} {bound}")


METRICS_INPUTS = ("inputs", "loss")


def metrics_inputs(include: Any, include_inputs: bool) -> list[str]:
    """``include_for_metrics`` checked (a list of "inputs" / "loss"; one string is taken as
    a list of it), with ``include_inputs_for_metrics=True`` adding "inputs" as transformers
    does."""
    items = [include] if isinstance(include, str) else list(include or [])
    bad = [i for i in items if i not in METRICS_INPUTS]
    if bad:
        raise ConfigError(
            f"TrainingArguments.include_for_metrics: {bad[0]!r} is not allowed; use a list "
            f"of {', '.join(repr(a) for a in METRICS_INPUTS)}"
        )
    if include_inputs and "inputs" not in items:
        items.append("inputs")
    return items


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_names(kwargs: dict[str, Any], names: list[str]) -> None:
    """An unknown keyword argument: ConfigError naming it and the closest argument."""
    import difflib

    for key in kwargs:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else "see docs/trainer.md for the arguments"
            raise ConfigError(f"TrainingArguments: unknown argument {key!r}; {hint}")


def flag_kind(annotation: Any) -> str | None:
    """The flag kind of a dataclass field's annotation: "bool", "bool | None" or None.

    The annotations are strings (from __future__ import annotations) until transformers'
    HfArgumentParser resolves them: it writes the real types back into the fields of the
    class it parses."""
    if isinstance(annotation, str):
        return annotation if annotation in ("bool", "bool | None") else None
    if annotation is bool:
        return "bool"
    import typing

    if set(typing.get_args(annotation)) == {bool, type(None)}:
        return "bool | None"
    return None


def check_bools(args: Any) -> None:
    """A flag must be True or False: the string "false" is truthy and would turn it on."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        kind = flag_kind(f.type)
        if kind is not None and not isinstance(value, bool):
            if value is None and kind == "bool | None":
                continue
            raise ConfigError(
                f"TrainingArguments.{f.name}: {value!r} is not allowed; use True or False"
                + (" (a non-empty string counts as True)" if isinstance(value, str) else "")
            )


def check_liger(config: Any, enabled: bool) -> None:
    """``liger_kernel_config``: kernel names to True/False. With ``use_liger_kernel``,
    the kernels other than the fused linear cross-entropy (which is ``loss.chunked``) are
    said to do nothing."""
    if config is None:
        return
    if not isinstance(config, dict) or not all(
        isinstance(k, str) and isinstance(v, bool) for k, v in config.items()
    ):
        raise ConfigError(
            f"TrainingArguments.liger_kernel_config: {config!r} is not allowed; use a dict of "
            'kernel names to True/False, e.g. {"fused_linear_cross_entropy": True}'
        )
    inert = sorted(k for k, v in config.items() if v and k != "fused_linear_cross_entropy")
    if enabled and inert:
        import logging

        logging.getLogger("meshtrain").warning(
            "TrainingArguments.liger_kernel_config: %s do nothing in meshtrain (only the "
            "fused linear cross-entropy is mapped, to loss.chunked)",
            ", ".join(inert),
        )
