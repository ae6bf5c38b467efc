"""Models and saved state of the Accelerator, under accelerate's names: ``unwrap_model``,
``get_state_dict``, ``save_model``, ``save``, ``register_for_checkpointing``,
``save_state`` / ``load_state`` (each engine's sharded checkpoint, models without an
engine, loader positions, schedulers, registered objects, RNG states; ``load_state`` also
reads the folders accelerate's own ``save_state`` writes: ``peer_state``). A mixin of
``Accelerator`` reading its prepared objects."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtrain.accelerate.engine_config import load_rng_state, rng_state, save_rng_state
from meshtrain.accelerate.prepared import PreparedModel
from meshtrain.errors import ConfigError


class StateIO:
    # models and state ----------------------------------------------------------------------------
    def _prepared(self, model: Any) -> PreparedModel | None:
        if isinstance(model, PreparedModel):
            return model
        return next((m for m in self._models if m.module is model), None)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, **_: Any) -> nn.Module:
        """The user's module (parameters sharded under ZeRO-3: see ``get_state_dict``)."""
        prepared = self._prepared(model)
        return model if prepared is None else prepared.module

    def get_state_dict(self, model: Any = None, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict, every parameter whole (gathered under ZeRO-3). Every rank
        must call it. ``model`` defaults to the first prepared one."""
        prepared = self._prepared(model) if model is not None else (self._models or [None])[0]
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
        from meshtrain.accelerate.peft_io import is_peft_model, save_model, whole_for_save

        if not safe_serialization:
            raise ConfigError(
                "save_model(safe_serialization=False): meshtrain writes safetensors only "
                "(pickled weights can run code when loaded)"
            )
        unwrapped, prepared = self.unwrap_model(model), self._prepared(model)
        engine = None if prepared is None else prepared.engine
        if engine is not None and not is_peft_model(unwrapped):
            # accelerate keeps a tied weight under its first name only
            engine.save_weights(
                save_directory, max_shard_size, aliases=False, index_parameters=False
            )
            self.wait_for_everyone()
            return
        state = self.get_state_dict(model)
        with whole_for_save(engine, unwrapped):  # collective under ZeRO-3
            if self.is_main_process:
                save_model(unwrapped, state, Path(save_directory), merge_lora=merge_lora)
        self.wait_for_everyone()

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Write ``obj`` once (main process): a dict of tensors as safetensors, anything
        else with ``torch.save`` as accelerate does."""
        if self.is_main_process:
            if safe_serialization:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in obj.items()}, str(f))
            else:
                torch.save(obj, f)
        self.wait_for_everyone()

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
        self._custom.extend(objects)

    def save_state(self, output_dir: str | os.PathLike | None = None, **_: Any) -> Path:
        """Everything for an exact resume: each engine's checkpoint (model, optimizer,
        counters, scaler), models without an engine, schedulers, loader positions,
        registered objects and this rank's RNG states."""
        if output_dir is None:
            if self.project_dir is None:
                raise ConfigError("save_state(): give output_dir or Accelerator(project_dir=)")
            output_dir = Path(self.project_dir) / "checkpoints"
        out = Path(output_dir)
        client = {
            "dataloaders": [dl.state_dict() for dl in self._loaders],
            "schedulers": [s.state_dict() for s in self._schedulers],
            "custom": [o.state_dict() for o in self._custom],
            "step": self.step,
        }
        path = out
        rank, rng = self.process_index, rng_state()  # the states at the save, not at the commit
        for i, engine in enumerate(self.engines):
            saved = engine.save_checkpoint(
                out,
                tag=_tag(i),
                client_state=client if i == 0 else {},
                # after the commit: in the background under checkpoint.async_save
                on_commit=(lambda p: save_rng_state(Path(p), rank, rng)) if i == 0 else None,
            )
            path = Path(saved) if i == 0 else path
        out.mkdir(parents=True, exist_ok=True)
        if not self.engines:
            if self.is_main_process:
                import json

                (out / "accelerator_client.json").write_text(json.dumps(client), encoding="utf-8")
            path = out
        if self.is_main_process:
            from safetensors.torch import save_file

            for i, m in enumerate(self._models):
                if m.engine is None:
                    state = {k: v.contiguous() for k, v in m.module.state_dict().items()}
                    save_file(state, str(out / f"model_{i}.safetensors"))
        if not self.engines:
            save_rng_state(Path(path), rank, rng)
        self.wait_for_everyone()
        return path

    def load_state(self, input_dir: str | os.PathLike, **_: Any) -> None:
        """Resume what ``save_state`` wrote, meshtrain's or accelerate's
        (``peer_state``): the same objects prepared in the same order."""
        import json

        from meshtrain.interop.accelerate_source import is_accelerate_folder

        inp = Path(input_dir)
        if is_accelerate_folder(inp):
            from meshtrain.accelerate.peer_state import load_accelerate_folder

            step = load_accelerate_folder(
                inp,
                models=self._models,
                optimizers=self._optimizers,
                schedulers=self._schedulers,
                custom=self._custom,
                rank=self.process_index,
                device=self.device,
            )
            self.step = self.step if step is None else step
            self.wait_for_everyone()
            return
        client: dict = {}
        path = inp
        for i, engine in enumerate(self.engines):
            loaded, got = engine.load_checkpoint(inp, tag=_tag(i))
            if loaded is None:
                raise ConfigError(f"load_state: no checkpoint '{_tag(i)}' under {inp}")
            if i == 0:
                path, client = Path(loaded), got or {}
        if not self.engines and (inp / "accelerator_client.json").exists():
            client = json.loads((inp / "accelerator_client.json").read_text(encoding="utf-8"))
        from safetensors.torch import load_file

        for i, m in enumerate(self._models):
            f = inp / f"model_{i}.safetensors"
            if m.engine is None and f.exists():
                m.module.load_state_dict(load_file(str(f), device=str(self.device)))
        for dl, st in zip(self._loaders, client.get("dataloaders", []), strict=False):
            dl.load_state_dict(st)
        for s, st in zip(self._schedulers, client.get("schedulers", []), strict=False):
            s.load_state_dict(st)
        for o, st in zip(self._custom, client.get("custom", []), strict=False):
            o.load_state_dict(st)
        self.step = int(client.get("step", 0))
        load_rng_state(Path(path), self.process_index)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """accelerate's: the loader of one pass from its ``num_batches``-th batch
        (``skipped_loader``); after ``load_state`` at that batch it changes nothing."""
        from meshtrain.accelerate.skipped_loader import SkippedLoader

        return SkippedLoader(dataloader, num_batches)

    def free_memory(self, *objects: Any) -> tuple:
        """Drop every reference the Accelerator holds (engines, loaders, ...)."""
        for m in self._models:
            if m.driver is not None:
                m.driver.remove()
            for h in m.__dict__.pop("hooks", []):
                h.remove()
        self._models, self._optimizers, self._loaders = [], [], []
        self._schedulers, self._custom = [], []
        self._active_loader = None
        self.step = 0
        return tuple(None for _ in objects)

    clear = free_memory


def _tag(i: int) -> str:
    return "accelerator_state" if i == 0 else f"accelerator_state_{i}"


__all__ = ["StateIO"]
