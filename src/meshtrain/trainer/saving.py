"""What the Trainer writes besides its checkpoints: ``save_model``, ``save_state`` and the
``save_pretrained`` export that both they and every ``checkpoint-<step>`` carry
(``ModelSaver``, which the Trainer builds and holds as ``trainer.saver``; the training
loop calls its ``export`` / ``export_files`` / ``write_args`` for each checkpoint).

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


class ModelSaver:
    """``save_model`` / ``save_state`` and the export a checkpoint carries, for one Trainer.

    It holds the Trainer and reads its public members when it writes (``args``, ``model``,
    ``engine``, which set-up builds later, ``model_handed_back``, ``processing_class``,
    ``state``), and asks it ``is_world_process_zero()``, so a subclass's override decides
    which process writes, as in transformers."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def save_model(self, output_dir: str | None = None) -> None:
        """The model's whole weights into ``output_dir`` (default ``args.output_dir``); see
        the module docstring. Every rank must call it."""
        from meshtrain.accelerate.peft_io import is_peft_model, prompt_embeddings

        trainer = self.trainer
        engine, model = trainer.engine, trainer.model
        path = Path(output_dir or trainer.args.output_dir)
        peft = is_peft_model(model)
        handed_back = trainer.model_handed_back
        if engine is not None and not handed_back and not peft:
            engine.save_weights(path)  # collective: from the ranks' own shards
            if trainer.is_world_process_zero():
                self.export_files(path)
                self.write_args(path)
            barrier()
            return
        if engine is not None and not (handed_back and not peft):
            state_dict = engine.module_state_dict()  # collective: every rank gathers
        else:  # before train(), or handed back after it: the user's model is whole here
            state_dict = model.state_dict()
        prompts = prompt_embeddings(engine, model)  # collective under ZeRO-3
        if trainer.is_world_process_zero():
            path.mkdir(parents=True, exist_ok=True)
            self.export(path, state_dict, prompts)
            self.write_args(path)
        barrier()

    def write_args(self, path: Path) -> None:
        """``training_args.json`` (transformers pickles ``training_args.bin``)."""
        args = self.trainer.args
        (path / ARGS_FILE).write_text(json.dumps(args.to_dict(), indent=2, default=str) + "\n")

    def save_state(self) -> None:
        """``trainer_state.json`` (log history, best checkpoint, step) in ``output_dir``."""
        trainer = self.trainer
        if trainer.is_world_process_zero():
            path = Path(trainer.args.output_dir)
            path.mkdir(parents=True, exist_ok=True)
            trainer.state.save_to_json(path / "trainer_state.json")

    def export_files(self, path: Path) -> None:
        """Rank 0: the model's files besides the weights the ranks wrote (``config.json``,
        ``generation_config.json``) and the tokenizer / processor."""
        model, processing = self.trainer.model, self.trainer.processing_class
        if hasattr(model, "save_pretrained"):
            model_files(model, path)
        if hasattr(processing, "save_pretrained"):
            processing.save_pretrained(path)

    def export(self, path: Path, state_dict: dict[str, Any], prompts=None) -> None:
        """Rank 0: the model's files into ``path`` (an existing folder). ``prompts``: a
        prompt-learning peft model's embeddings, computed by every rank beforehand
        (``peft_io.prompt_embeddings``), so peft does not run its encoder on ZeRO-3 shards
        here on one rank (a hang)."""
        from meshtrain.accelerate.peft_io import saved_prompts

        model, processing = self.trainer.model, self.trainer.processing_class
        if hasattr(model, "save_pretrained"):
            with saved_prompts(model, prompts):
                model.save_pretrained(path, state_dict=state_dict)
            if hasattr(processing, "save_pretrained"):
                processing.save_pretrained(path)
            return
        from safetensors.torch import save_file

        # clones: tied weights share storage, which safetensors refuses to write twice
        tensors = {k: v.detach().clone().contiguous() for k, v in state_dict.items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def barrier() -> None:
    """Every process waits for the others (a no-op on one process): after rank 0 wrote
    the files the others may read."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def is_world_process_zero() -> bool:
    """Whether this is global rank 0 (the process that writes shared files)."""
    return _rank("RANK") == 0


def is_local_process_zero() -> bool:
    """Whether this is rank 0 of its node."""
    return _rank("LOCAL_RANK") == 0


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


__all__ = [
    "ModelSaver",
    "barrier",
    "is_local_process_zero",
    "is_world_process_zero",
    "model_files",
]
