"""Models and saved state of the Accelerator, under accelerate's names: ``unwrap_model``,
``get_state_dict``, ``save_model``, ``save``, ``register_for_checkpointing``,
``save_state`` / ``load_state`` (each engine's sharded checkpoint, models without an
engine, loader positions, schedulers, registered objects, RNG states; ``load_state`` also
reads the folders accelerate's own ``save_state`` writes: ``peer_state``). Reads the
Accelerator's ``PreparedObjects`` and asks its ``ProcessQueries`` which rank writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtrain.accelerate import peft_io
from meshtrain.accelerate.engine_config import load_rng_state, rng_state, save_rng_state
from meshtrain.accelerate.peer_state import load_accelerate_folder
from meshtrain.accelerate.prepared_objects import PreparedObjects
from meshtrain.accelerate.process_queries import ProcessQueries
from meshtrain.errors import ConfigError
from meshtrain.interop.accelerate_source import is_accelerate_folder


class StateIO:
    def __init__(self, prepared: PreparedObjects, processes: ProcessQueries) -> None:
        self.prepared = prepared
        self.processes = processes

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, **_: Any) -> nn.Module:
        """The user's module (parameters sharded under ZeRO-3: see ``get_state_dict``)."""
        prepared = self.prepared.model_of(model)
        return model if prepared is None else prepared.module

    def get_state_dict(self, model: Any = None, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict, every parameter whole (gathered under ZeRO-3). Every rank
        must call it. ``model`` defaults to the first prepared one."""
        prepared = (
            self.prepared.model_of(model)
            if model is not None
            else (self.prepared.models or [None])[0]
        )
        if prepared is None:
            if isinstance(model, nn.Module):
                return {k: v.detach().clone() for k, v in model.state_dict().items()}
            raise ConfigError("get_state_dict: prepare a model first")
        if prepared.engine is None:
            return {k: v.detach().clone() for k, v in prepared.module.state_dict().items()}
        return prepared.engine.module_state_dict()

    def save_model(
        self,
        model: Any,
        save_directory: str | os.PathLike,
        *,
        merge_lora: bool = False,
        safe_serialization: bool = True,
        max_shard_size: int | str = "10GB",
    ) -> None:
        """Save the model for ``from_pretrained``: a peft model saves its adapter only (or,
        with ``merge_lora``, the base model with the adapter merged in); other models save
        accelerate's files: ``model.safetensors``, or past ``max_shard_size``
        ``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json``, each
        name of a tied weight kept once, written by the ranks that hold the weights (no
        rank holds the whole model: ``engine.save_weights``). Every rank must call it."""
        if not safe_serialization:
            raise ConfigError(
                "save_model(safe_serialization=False): meshtrain writes safetensors only "
                "(pickled weights can run code when loaded)"
            )
        unwrapped, prepared = self.unwrap_model(model), self.prepared.model_of(model)
        engine = None if prepared is None else prepared.engine
        if engine is not None and not peft_io.is_peft_model(unwrapped):
            # accelerate keeps a tied weight under its first name only
            engine.save_weights(
                save_directory, max_shard_size, aliases=False, index_parameters=False
            )
            self.processes.wait_for_everyone()
            return
        state = self.get_state_dict(model)
        with peft_io.whole_for_save(engine, unwrapped):  # collective under ZeRO-3
            if self.processes.is_main_process:
                peft_io.save_model(unwrapped, state, Path(save_directory), merge_lora=merge_lora)
        self.processes.wait_for_everyone()

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Write ``obj`` once (main process): a dict of tensors as safetensors, anything
        else with ``torch.save`` as accelerate does."""
        if self.processes.is_main_process:
            if safe_serialization:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in obj.items()}, str(f))
            else:
                torch.save(obj, f)
        self.processes.wait_for_everyone()

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` (JSON-able state) that
        ``save_state`` / ``load_state`` carry too."""
        bad = [
            o for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if bad:
            raise ValueError(
                "register_for_checkpointing: these objects have no state_dict / "
                f"load_state_dict: {[type(o).__name__ for o in bad]}"
            )
        self.prepared.custom.extend(objects)

    def save_state(
        self, output_dir: str | os.PathLike | None, step: int, project_dir: str | None
    ) -> Path:
        """Everything for an exact resume: each engine's checkpoint (model, optimizer,
        counters, scaler), models without an engine, schedulers, loader positions,
        registered objects, the micro-step ``step`` and this rank's RNG states (under
        ``project_dir/checkpoints`` when ``output_dir`` is None)."""
        if output_dir is None:
            if project_dir is None:
                raise ConfigError("save_state(): give output_dir or Accelerator(project_dir=)")
            output_dir = Path(project_dir) / "checkpoints"
        out = Path(output_dir)
        client = {
            "dataloaders": [dl.state_dict() for dl in self.prepared.loaders],
            "schedulers": [s.state_dict() for s in self.prepared.schedulers],
            "custom": [o.state_dict() for o in self.prepared.custom],
            "step": step,
        }
        path = out
        rank, rng = (
            self.processes.process_index,
            rng_state(),
        )  # the states at the save, not at the commit
        for i, engine in enumerate(self.prepared.engines):
            saved = engine.save_checkpoint(
                out,
                tag=_tag(i),
                client_state=client if i == 0 else {},
                # after the commit: in the background under checkpoint.async_save
                on_commit=(lambda p: save_rng_state(Path(p), rank, rng)) if i == 0 else None,
            )
            path = Path(saved) if i == 0 else path
        out.mkdir(parents=True, exist_ok=True)
        if not self.prepared.engines:
            if self.processes.is_main_process:
                (out / "accelerator_client.json").write_text(json.dumps(client), encoding="utf-8")
            path = out
        if self.processes.is_main_process:
            from safetensors.torch import save_file

            for i, m in enumerate(self.prepared.models):
                if m.engine is None:
                    state = {k: v.contiguous() for k, v in m.module.state_dict().items()}
                    save_file(state, str(out / f"model_{i}.safetensors"))
        if not self.prepared.engines:
            save_rng_state(Path(path), rank, rng)
        self.processes.wait_for_everyone()
        return path

    def load_state(self, input_dir: str | os.PathLike, step: int) -> int:
        """Resume what ``save_state`` wrote, meshtrain's or accelerate's
        (``peer_state``): the same objects prepared in the same order. Returns the saved
        micro-step (``step``, the current one, where accelerate's folder has none)."""
        inp = Path(input_dir)
        if is_accelerate_folder(inp):
            saved = load_accelerate_folder(
                inp,
                models=self.prepared.models,
                optimizers=self.prepared.optimizers,
                schedulers=self.prepared.schedulers,
                custom=self.prepared.custom,
                rank=self.processes.process_index,
                device=self.processes.device,
            )
            self.processes.wait_for_everyone()
            return step if saved is None else saved
        client: dict = {}
        path = inp
        for i, engine in enumerate(self.prepared.engines):
            loaded, got = engine.load_checkpoint(inp, tag=_tag(i))
            if loaded is None:
                raise ConfigError(f"load_state: no checkpoint '{_tag(i)}' under {inp}")
            if i == 0:
                path, client = Path(loaded), got or {}
        if not self.prepared.engines and (inp / "accelerator_client.json").exists():
            client = json.loads((inp / "accelerator_client.json").read_text(encoding="utf-8"))
        from safetensors.torch import load_file

        for i, m in enumerate(self.prepared.models):
            f = inp / f"model_{i}.safetensors"
            if m.engine is None and f.exists():
                m.module.load_state_dict(load_file(str(f), device=str(self.processes.device)))
        for dl, st in zip(self.prepared.loaders, client.get("dataloaders", []), strict=False):
            dl.load_state_dict(st)
        for s, st in zip(self.prepared.schedulers, client.get("schedulers", []), strict=False):
            s.load_state_dict(st)
        for o, st in zip(self.prepared.custom, client.get("custom", []), strict=False):
            o.load_state_dict(st)
        load_rng_state(Path(path), self.processes.process_index)
        return int(client.get("step", 0))


def _tag(i: int) -> str:
    return "accelerator_state" if i == 0 else f"accelerator_state_{i}"


__all__ = ["StateIO"]
