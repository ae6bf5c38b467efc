"""What the Trainer writes besides its checkpoints: ``save_model``, ``save_state`` and the
``save_pretrained`` export that both they and every ``checkpoint-<step>`` carry.

``save_model`` is collective, as in transformers under DeepSpeed: every rank calls it.

* The weights are written by the ranks that hold them (``engine.save_weights``: ZeRO-3
  shards, tensor-parallel shards and pipeline stages each send their part to the file's
  writer, and no rank holds the whole model): ``model.safetensors``, or
  ``model-0000K-of-0000N.safetensors`` plus the index past ``max_shard_size`` (50GB, as
  ``save_pretrained``). A transformers model is written without tied names, as
  ``save_pretrained`` writes it; any other ``nn.Module`` with each name of its state dict.
* Rank 0 writes the rest of ``save_pretrained``'s folder for a transformers model
  (``config.json`` with its dtype and architectures, ``generation_config.json``) and
  the tokenizer / processor the Trainer holds, so ``AutoModel.from_pretrained(output_dir)``
  works; and ``training_args.json`` (transformers pickles ``training_args.bin``; meshtrain
  never writes a file that needs an unsafe load to read).
* A peft model saves the adapter only (``adapter_config.json`` +
  ``adapter_model.safetensors``, what ``PeftModel.from_pretrained`` loads), from weights
  gathered first (an adapter is small). After ``train()`` the user's model holds the whole
  trained weights on every rank (handed back), and before it there is no engine: rank 0
  writes those.

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
        from meshtrain.accelerate.peft_io import is_peft_model, prompt_embeddings

        path = Path(output_dir or self.args.output_dir)
        peft = is_peft_model(self.model)
        if self.engine is not None and not self._handed_back and not peft:
            self.engine.save_weights(path)  # collective: from the ranks' own shards
            if self.is_world_process_zero():
                self._export_files(path)
                self._write_args(path)
            self._barrier()
            return
        if self.engine is not None and not (self._handed_back and not peft):
            state_dict = self.engine.module_state_dict()  # collective: every rank gathers
        else:  # before train(), or handed back after it: the user's model is whole here
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

    def _export_files(self, path: Path) -> None:
        """Rank 0: the model's files besides the weights the ranks wrote (``config.json``,
        ``generation_config.json``) and the tokenizer / processor."""
        if hasattr(self.model, "save_pretrained"):
            model_files(self.model, path)
        if hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(path)

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


def model_files(model, path: Path) -> None:
    """What ``save_pretrained`` writes besides the weights: ``config.json`` (recording the
    model's dtype and class, as transformers does), ``generation_config.json`` for a
    model that generates, and a remote-code model's own source files."""
    config = model.config
    config.dtype = str(model.dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    if getattr(model, "is_remote_code", lambda: False)():
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, path, config=config)
    config.save_pretrained(path)
    if getattr(model, "can_generate", lambda: False)():
        model.generation_config.save_pretrained(path)


def _rank(variable: str) -> int:
    import torch.distributed as dist

    if variable == "RANK" and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get(variable, "0"))


__all__ = ["ModelSaving"]
