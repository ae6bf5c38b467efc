"""Generate ``docs/config.md`` from the models' field docstrings (so the page cannot go stale).

``python -m meshtrain.config --markdown > docs/config.md`` rewrites it; a test compares the
file with :func:`config_reference_markdown`. The error examples are produced by actually
loading bad configs, so they show the real messages.
"""

from __future__ import annotations

import json
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from meshtrain.config._errors import bounds_text, models_in, strip_annotated, union_members
from meshtrain.config.loading import load_config
from meshtrain.config.optimizer import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from meshtrain.config.resolve import AUTO_DEFAULTS
from meshtrain.config.root import Config
from meshtrain.errors import ConfigError

_SIMPLE = {int: "int", float: "float", bool: "bool", str: "string", type(None): "null"}

INTRO = """\
# Config reference

meshtrain reads DeepSpeed's JSON config keys as users already write them, plus a few sections
of its own (`mesh`, `distributed`, and meshtrain fields in `activation_checkpointing`, `fp16`,
`checkpoint`). Load a config with:

```python
from meshtrain.config import load_config

config = load_config("ds_config.json")            # or .yaml / .yml, or a dict
config = load_config(cfg_dict, world_size=8)      # world size for the batch-size rule
config.zero_optimization.stage, config.precision  # 2, "bf16"
config.to_dict()                                  # JSON-serialisable; load_config(...) round-trips
```

Keys are exactly DeepSpeed's. Keys DeepSpeed accepts that meshtrain does not act on are
marked *Accepted and ignored*, so a copied config loads unchanged. Unknown keys are errors
that name the key and the closest valid one. Integer fields accept JSON floats such as `5e8`
when they are whole numbers, and numeric strings (YAML 1.1 reads `5e8` as a string).

This page is generated from the field docstrings by `python -m meshtrain.config --markdown`;
a test keeps it in sync.

## Batch sizes

`train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp`, where
the data-parallel size `dp = world_size / (mesh.pipeline_parallel_size * mesh.tensor_parallel_size)`
and the world size comes from the `world_size` argument, else `$WORLD_SIZE`, else
`$SLURM_NTASKS`, else `pp * tp` (dp = 1). The world size must be divisible by `pp * tp`.

| given | derived |
| --- | --- |
| all three | checked: the product must match |
| any two | the third (it must divide evenly) |
| only `train_batch_size` | `gradient_accumulation_steps = 1`, micro batch = `train_batch_size / dp` |
| only the micro batch | `gradient_accumulation_steps = 1`, `train_batch_size = micro * dp` |
| only `gradient_accumulation_steps` | micro batch 1 |
| none | micro batch 1, `gradient_accumulation_steps` 1 |

`load_config` applies the rule unless one of the three is `"auto"`. The engine calls
`config.resolve_batch_sizes(dp)` once it knows the real mesh: values you wrote are kept and
checked, values that were derived are derived again for the new `dp`.

## "auto" values

`"auto"` is the transformers DeepSpeed integration's placeholder for "take it from the
Trainer". It is accepted in the fields whose type below says `"auto"`.
`config.resolve_auto({"optimizer.params.lr": 1e-3, ...})` fills them by dotted path (only
values that are still `"auto"`; a number you wrote wins), and
`config.resolve_auto_defaults(hidden_size=...)` fills the rest with:

| path | default when nobody filled it |
| --- | --- |
"""

OPTIMIZER_NOTE = """\
DeepSpeed's `"Adam"` defaults to `adam_w_mode: true`, i.e. decoupled (AdamW-style) weight
decay; write `"adam_w_mode": false` for classic L2-coupled Adam. `"AdamW"` is always decoupled.
The valid `params` keys depend on `type`:
"""

BAD_EXAMPLES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("a misspelt section", {"zero_optimisation": {"stage": 2}}, {}),
    ("a misspelt nested key", {"zero_optimization": {"offload_optimizer": {"devices": "cpu"}}}, {}),
    ("a value out of range", {"zero_optimization": {"stage": 4}}, {}),
    ("a wrong type", {"train_micro_batch_size_per_gpu": "eight"}, {}),
    ("an unknown optimizer", {"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}, {}),
    (
        "a parameter of another optimizer",
        {"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}},
        {},
    ),
    ("both half precisions", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, {}),
    (
        "an inconsistent batch triple",
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        },
        {"world_size": 2},
    ),
    ("a mesh that does not fit", {"mesh": {"tensor_parallel_size": 4}}, {"world_size": 6}),
]


def _type_text(field: FieldInfo) -> str:
    parts: list[str] = []
    for member in union_members(field.annotation):
        member, meta = strip_annotated(member, list(field.metadata))
        if typing.get_origin(member) is Literal:
            parts += [json.dumps(v) for v in typing.get_args(member)]
        elif member in _SIMPLE:
            parts.append(_SIMPLE[member] + bounds_text(meta))
        elif isinstance(member, type) and issubclass(member, BaseModel):
            parts.append("section")
        elif typing.get_origin(member) is tuple:
            inner = strip_annotated(typing.get_args(member)[0], [])
            parts.append(f"[{_SIMPLE[inner[0]]}{bounds_text(inner[1])}, ...] (2 items)")
        elif typing.get_origin(member) is list:
            parts.append("list of " + _SIMPLE[strip_annotated(typing.get_args(member)[0], [])[0]])
        else:
            parts.append("mapping")
    return " or ".join(dict.fromkeys(parts))


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "`{}`" if models_in(field.annotation) else "required"
    default = field.default
    if default is PydanticUndefined:
        default = field.default_factory()  # type: ignore[misc]
    if isinstance(default, BaseModel):
        return "(section)"
    return "`" + json.dumps(list(default) if isinstance(default, tuple) else default) + "`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(model: type[BaseModel], skip: set[str] = frozenset()) -> list[str]:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        rows.append(
            f"| `{name}` | {_cell(_type_text(field))} | {_default_text(field)} "
            f"| {_cell(field.description or '')} |"
        )
    return rows


def _section(path: str, model: type[BaseModel], depth: int) -> list[str]:
    """Heading, the model's own docstring, its table, then nested sections."""
    heading = path if path.startswith("`") else f"`{path}`"
    path = path.split("`")[1] if path.startswith("`") else path
    lines = ["", "#" * depth + f" {heading}", "", _cell((model.__doc__ or "").strip()), ""]
    nested = {
        n: models_in(f.annotation) for n, f in model.model_fields.items() if models_in(f.annotation)
    }
    lines += _table(model)
    if path == "optimizer":
        lines += ["", OPTIMIZER_NOTE.rstrip()]
    for name, models in nested.items():
        for sub in models:
            title = f"`{path}.{name}`"
            if len(models) > 1:
                kinds = [k for k, m in {**OPTIMIZER_PARAMS, **SCHEDULER_PARAMS}.items() if m is sub]
                title += " for " + " and ".join(kinds)
            lines += _section(title, sub, depth + 1)
    return lines


def _error_examples() -> list[str]:
    lines = [
        "",
        "## Error messages",
        "",
        "Every error is a `meshtrain.ConfigError` naming the path:",
        "",
    ]
    for what, bad, kwargs in BAD_EXAMPLES:
        try:
            load_config(bad, **kwargs)
        except ConfigError as exc:
            message = str(exc)
        else:  # pragma: no cover - the docs test fails loudly
            message = "(no error: this example is broken)"
        where = f" (world size {kwargs['world_size']})" if kwargs else ""
        lines += [
            f"- {what}{where}: `{json.dumps(bad)}`",
            "",
            "  ```text",
            f"  {message}",
            "  ```",
            "",
        ]
    lines += [
        "A missing file, or invalid JSON/YAML, names the file and the line, e.g.",
        "`ds.json: invalid JSON at line 3, column 5: Expecting ',' delimiter`.",
    ]
    return lines


def config_reference_markdown() -> str:
    """The full text of docs/config.md."""
    lines = INTRO.splitlines()
    lines += [f"| `{path}` | {_cell(text)} |" for path, text in AUTO_DEFAULTS.items()]
    lines += _error_examples()
    top_sections = {n for n, f in Config.model_fields.items() if models_in(f.annotation)}
    lines += ["", "## Top-level keys", ""]
    lines += _table(Config, skip=top_sections)
    for name in Config.model_fields:
        if name in top_sections:
            (model,) = models_in(Config.model_fields[name].annotation)
            lines += _section(name, model, 2)
    return "\n".join(lines).rstrip() + "\n"
