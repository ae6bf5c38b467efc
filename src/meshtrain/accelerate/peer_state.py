"""``Accelerator.load_state`` on a folder accelerate 1.15's ``save_state`` wrote.

The objects are matched as accelerate matches them: by their place among the prepared
objects of their kind (models, optimizers, schedulers in ``prepare`` order; registered
objects in ``register_for_checkpointing`` order), the files named by
``interop.accelerate_source.suffixed``. In accelerate's order of loading:

* a model trained by an Engine, with its optimizer: ``engine.load_checkpoint`` of an
  ``AccelerateSource``, so each rank reads only its own slices of the weights and of the
  optimizer states whatever the layout (dp size, ZeRO stage); a model without an engine
  takes the whole state dict; an optimizer whose model was not prepared, its own;
* schedulers, registered objects, the fp16 loss scale (``scaler.pt``);
* the data position: accelerate saves none for a map-style loader (its ``sampler.bin`` /
  ``dl_state_dict.bin`` are refused by name), so the prepared loaders stay as prepared and
  ``skip_first_batches`` positions them, as under accelerate;
* this process's RNG states (``random_states_{rank}.pkl``) and the accumulation counter
  ``step`` they carry. A process with no such file (more processes than saved) keeps its
  own states, with a warning, as accelerate only logs it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from meshtrain.errors import CheckpointError
from meshtrain.interop.accelerate_source import (
    AccelerateSource,
    load_small,
    load_weights,
    read_rng,
    refuse_plugin_layouts,
    set_rng,
    suffixed,
)

log = logging.getLogger("meshtrain")


def load_accelerate_folder(
    folder: Path,
    *,
    models: list,
    optimizers: list,
    schedulers: list,
    custom: list,
    rank: int,
    device,
) -> int | None:
    """Load what ``folder`` holds into the prepared objects (module docstring). Returns
    the saved ``step`` (accumulation counter), or None when this rank's RNG file is
    absent."""
    refuse_plugin_layouts(folder)
    for i, m in enumerate(models):
        if m.engine is None:
            state = load_weights(folder, i)
            if state is None:
                raise CheckpointError(
                    f"{folder}: no {suffixed('model', i, 'safetensors')} or "
                    f"{suffixed('pytorch_model', i, 'bin')} for prepared model {i}; prepare "
                    "the same models in the same order as the run that saved it"
                )
            m.module.load_state_dict({k: v.to(device) for k, v in state.items()})
            continue
        j = next(j for j, o in enumerate(optimizers) if o.model is m)
        source = AccelerateSource(folder, i, j, optimizers[j].param_names)
        with source:  # closing releases the files
            m.engine.load_checkpoint(source)
    for j, o in enumerate(optimizers):
        if o.model is None:  # its model was not prepared: the optimizer as it is
            o.optimizer.load_state_dict(load_small(_needed(folder, "optimizer", j, "bin")))
    for j, s in enumerate(schedulers):
        s.load_state_dict(load_small(_needed(folder, "scheduler", j, "bin")))
    for k, obj in enumerate(custom):
        path = folder / f"custom_checkpoint_{k}.pkl"
        if not path.is_file():
            raise CheckpointError(
                f"{path}: missing for registered object {k} ({type(obj).__name__}); "
                "register the same objects in the same order as the run that saved it"
            )
        obj.load_state_dict(load_small(path))
    scaler = folder / "scaler.pt"
    engines = [m.engine for m in models if m.engine is not None]
    if scaler.is_file() and engines and engines[0].scaler.dynamic:
        # torch's GradScaler: its scale carries over; its growth counter counts towards
        # another interval (growth_interval), so the engine's own window starts afresh
        engines[0].scaler.load_state_dict({"scale": float(load_small(scaler)["scale"])})
    rng = folder / f"random_states_{rank}.pkl"
    if not rng.is_file():
        log.warning(
            "load_state: %s is missing (the save had fewer processes); this process keeps "
            "its own RNG states",
            rng,
        )
        return None
    states = read_rng(rng)
    set_rng(states)
    return int(states.get("step", 0))


def _needed(folder: Path, stem: str, index: int, ext: str) -> Path:
    path = folder / suffixed(stem, index, ext)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing for prepared {stem} {index}; copy the whole save_state folder, "
            f"and prepare the same {stem}s in the same order as the run that saved it"
        )
    return path


__all__ = ["load_accelerate_folder"]
