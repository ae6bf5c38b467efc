"""The model's blocks: which modules are "the layers" of a model.

Several parallel features need the same answer and must agree on it: activation
checkpointing wraps each block, ZeRO-3 gathers parameters unit by unit, and the pipeline
split and tensor-parallel plans walk the same list. They all ask this module.

* ``block_list(model)``: the children of the model's first non-empty ``nn.ModuleList`` (in
  ``modules()`` order): the decoder layers of a Llama, GPT-2's ``h``, BERT's encoder layers,
  meshtrain's reference decoder's ``layers``.
* ``modules_of_classes(model, names, field)``: the instances of the named classes; a name
  that matches nothing is a ConfigError naming the config ``field`` and the classes present.
* ``gather_units(model, names)``: ZeRO-3's units: the named classes (outermost matches
  only), else each block of the outermost ``ModuleList``/``Sequential`` plus each other
  child on the way (for a Llama: the embedding, every decoder layer, the final norm, the
  head).
"""

from __future__ import annotations

from torch import nn

from meshtrain.errors import ConfigError

CONTAINERS = (nn.ModuleList, nn.Sequential)


def modules_of_classes(
    model: nn.Module, class_names: list[str], field: str, outermost: bool = False
) -> list[nn.Module]:
    """The modules of ``model`` whose class name is listed (only the outermost of nested
    matches with ``outermost``); ConfigError naming config ``field`` when a name matches
    nothing."""
    wanted = set(class_names)
    found, inside = [], set()
    for m in model.modules():
        if type(m).__name__ in wanted and id(m) not in inside:
            found.append(m)
            if outermost:
                inside.update(id(s) for s in m.modules())
    present = sorted({type(m).__name__ for m in model.modules()})
    missing = wanted - set(present)  # a class nested inside a match is not missing
    if missing:
        raise ConfigError(
            f"{field}: {sorted(missing)} not found in the model; its module classes are {present}"
        )
    return found


def block_list(model: nn.Module) -> list[nn.Module]:
    """Each block of the model's first non-empty ``nn.ModuleList`` ([] if it has none)."""
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m):
            return list(m)
    return []


def blocks(model: nn.Module, class_names: list[str] | None, field: str) -> list[nn.Module]:
    """The named classes' instances when ``class_names`` is given, else ``block_list``."""
    if class_names:
        return modules_of_classes(model, list(class_names), field)
    return block_list(model)


def _has_container(module: nn.Module) -> bool:
    return any(isinstance(m, CONTAINERS) for m in module.modules())


def _split(module: nn.Module) -> list[nn.Module]:
    units: list[nn.Module] = []
    for child in module.children():
        # a ModuleDict is never called itself (peft keeps its prompt encoders in one):
        # as a unit its hooks would never fire, so its members are the units
        if isinstance(child, (*CONTAINERS, nn.ModuleDict)):
            units.extend(child.children())
        elif _has_container(child):
            units.extend(_split(child))
        else:
            units.append(child)
    return units


def gather_units(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """ZeRO-3's gather units of ``model`` in registration order (see module docstring);
    units without parameters are dropped, and a model with no children is one unit."""
    if class_names:
        field = "zero_optimization.stage3_module_classes"
        units = modules_of_classes(model, list(class_names), field, outermost=True)
    else:
        units = _split(model) if _has_container(model) else list(model.children())
    units = [u for u in units if any(True for _ in u.parameters())]
    return units or [model]


__all__ = ["CONTAINERS", "block_list", "blocks", "gather_units", "modules_of_classes"]
