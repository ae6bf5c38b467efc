"""What the Trainer writes besides its checkpoints: ``save_model``, ``save_state`` and the
``save_pretrained`` export that both they and every ``checkpoint-<step>`` carry.

``save_model`` is collective, as in transformers under DeepSpeed: every rank calls it,
because the whole weights are gathered first (ZeRO-3 shards, tensor-parallel shards,
pipeline stages: ``engine.module_state_dict()``); rank 0 then writes

* for a transformers model, ``save_pretrained``'s files (``config.json`` +
  ``model.safetensors``) and the tokenizer / processor the Trainer holds, so
  ``AutoModel.from_pretrained(output_dir)`` works; for a peft model, the adapter only
  (``adapter_config.json`` + ``adapter_model.safetensors``, what
  ``PeftModel.from_pretrained`` loads);
* for any other ``nn.Module``, ``model.safetensors`` of its state dict;
* ``training_args.json`` (transformers pickles ``training_args.bin``; meshtrain never
  writes a file that needs an unsafe load to read).

A prompt-learning peft model (prompt / prefix tuning) under ZeRO-3: peft computes the
embeddings it saves by running the prompt encoder, whose weights are shards; every rank
computes them together first (``peft_io.prompt_embeddings``) and rank 0 hands them to
peft, in ``save_model`` and in each ``checkpoint-<step>``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ARGS_FILE = "training_args.json"


class ModelSaving:
    """``save_model`` / ``save_state`` / ``is_world_process_zero`` of the Trainer (a mixin
    on its ``args``, ``model``, ``engine``, ``state`` and ``processing_class``)."""

    def is_world_process_zero(self) -> bool:
        """Whether this is global rank 0 (the process that writes shared files)."""
        return _rank("RANK") == 0

    def is_local_process_zero(self) -> bool:
        """Whether this is rank 0 of its node."""
        return _rank("LOCAL_RANK") == 0

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model's whole weights into ``output_dir`` (default ``args.output_dir``); see
        the module docstring. Every rank must call it."""
        from meshtrain.accelerate.peft_io import prompt_embeddings

        path = Path(output_dir or self.args.output_dir)
        if self.engine is not None:
            state_dict = self.engine.module_state_dict()  # collective: every rank gathers
        else:  # before train(): the user's model as it is
            state_dict = self.model.state_dict()
        prompts = prompt_embeddings(self.engine, self.model)  # collective under ZeRO-3
        if self.is_world_process_zero():
            path.mkdir(parents=True, exist_ok=True)
            self._export(path, state_dict, prompts)
            self._write_args(path)
        self._barrier()

    def _write_args(self, path: Path) -> None:
        """``training_args.json`` (transformers pickles ``training_args.bin``)."""
        (path / ARGS_FILE).write_text(json.dumps(self.args.to_dict(), indent=2, default=str) + "\n")

    def save_state(self) -> None:
        """``trainer_state.json`` (log history, best checkpoint, step) in ``output_dir``."""
        if self.is_world_process_zero():
            path = Path(self.args.output_dir)
            path.mkdir(parents=True, exist_ok=True)
            self.state.save_to_json(path / "trainer_state.json")

    def _export(self, path: Path, state_dict: dict[str, Any], prompts=None) -> None:
        """Rank 0: the model's files into ``path`` (an existing folder). ``prompts``: a
        prompt-learning peft model's embeddings, computed by every rank beforehand
        (``peft_io.prompt_embeddings``), so peft does not run its encoder on ZeRO-3 shards
        here on one rank (a hang)."""
        from meshtrain.accelerate.peft_io import saved_prompts

        if hasattr(self.model, "save_pretrained"):
            with saved_prompts(self.model, prompts):
                self.model.save_pretrained(path, state_dict=state_dict)
            if hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(path)
            return
        from safetensors.torch import save_file

        # clones: tied weights share storage, which safetensors refuses to write twice
        tensors = {k: v.detach().clone().contiguous() for k, v in state_dict.items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    def _barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


def _rank(variable: str) -> int:
    import torch.distributed as dist

    if variable == "RANK" and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get(variable, "0"))


__all__ = ["ModelSaving"]
