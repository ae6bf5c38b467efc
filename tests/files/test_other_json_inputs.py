"""The JSON files meshtrain reads besides configs, data and manifests go through the one
reading path too (issue 32): a LoRA ``adapter_config.json`` (``--merge-lora``), a weight
index of a sharded ``save_pretrained`` folder (sliced loading) and a Trainer checkpoint's
``trainer_state.json``. Real files, each damage one line naming the file and position."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from meshtrain.errors import CheckpointError
from meshtrain.interop.merge_lora import read_adapter_config
from meshtrain.interop.safetensors_source import SafetensorsSource
from meshtrain.trainer.state import TrainerState


def test_adapter_config_truncated_is_named(tmp_path):
    f = tmp_path / "adapter_config.json"
    f.write_text('{\n  "peft_type": "LORA",\n  "r": 8,\n  "lora_alpha": 1')
    with pytest.raises(CheckpointError, match=rf"{f}: the JSON ends early \(the file is "
                       r"truncated or incomplete\) at line 4, column 18"):  # fmt: skip
        read_adapter_config(tmp_path)
    f.write_text('{"peft_type": "LORA", "r": 8}')
    assert read_adapter_config(tmp_path)["r"] == 8


def test_weight_index_duplicate_key_is_named(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {\n "a": "model-00001.safetensors",\n'
                     ' "a": "model-00002.safetensors"}}')  # fmt: skip
    with pytest.raises(CheckpointError, match=r"index\.json: duplicate key 'a' at line 3, column 2 "
                       r"\(first at line 2, column 2\)"):  # fmt: skip
        SafetensorsSource(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors"}}))
    assert SafetensorsSource(tmp_path).shape("a") == (2,)


def test_trainer_state_latin1_is_named(tmp_path):
    f = tmp_path / "trainer_state.json"
    f.write_bytes(b'{"global_step": 3,\n "best_model_checkpoint": "caf\xe9"}')
    with pytest.raises(CheckpointError, match=rf"{f}: byte 0xe9 at line 2, column 31 is not "
                       "valid UTF-8"):  # fmt: skip
        TrainerState.load_from_json(f)
    f.write_text('{"global_step": 3}')
    assert TrainerState.load_from_json(f).global_step == 3
