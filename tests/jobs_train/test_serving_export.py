"""The export ``meshtrain train`` writes for ``meshtrain serve``: the reference decoder as a
transformers Llama with the same logits, the char tokenizer with the same ids, and a run
folder that ``meshtrain serve OUTPUT_DIR`` resolves to it. One process, no training."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from meshtrain.jobs.train.corpus import CharTokenizer
from meshtrain.jobs.train.serving_export import export_for_serving, why_not_exportable
from meshtrain.models.decoder import Decoder, DecoderConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason='needs pip install "meshtrain[hf]"'
)

TEXT = "迈向充满希望的新世纪——一九九八年新年讲话（附图片１张）中共中央总书记、国家主席江泽民"


def test_exported_llama_and_tokenizer_match_the_decoder(tmp_path):
    """Logits of the exported ``LlamaForCausalLM`` equal the Decoder's within 1e-5.

    Why not bitwise: the export reorders each head's query/key rows (meshtrain rotates
    pairs (2i, 2i+1), Llama (i, i + hd/2)), so each score ``q . k`` sums the same
    products in another order, and Llama computes its rotary angles in fp32 where
    meshtrain uses fp64 then rounds. Bound: a reordered fp32 sum of n terms differs by
    at most ~n u sum|terms| (u = 6e-8); here n <= max(dim, ffn_dim) = 64 and the
    activations of a 0.02-initialised 2-layer model are O(1) per term, a few times
    1e-6 at the logits after two blocks; 1e-5 leaves a margin (measured: ~4e-8)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshtrain.serve.model_loading import resolve

    tok = CharTokenizer.build([TEXT], min_count=1)
    cfg = DecoderConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=48,
        tie_embeddings=True, seed=7,
    )  # fmt: skip
    model = Decoder(cfg)
    assert why_not_exportable(cfg, tok) is None
    (tmp_path / "checkpoints").mkdir()  # what makes the folder a run for serve
    (tmp_path / "config.json").write_text("{}")  # the job's config: not a model's
    folder = export_for_serving(model, tok, tmp_path)
    assert folder == tmp_path / "model"
    resolved = resolve(tmp_path)
    assert resolved.path == folder and resolved.kind == "pretrained"

    llama = AutoModelForCausalLM.from_pretrained(folder)
    fast = AutoTokenizer.from_pretrained(folder)
    ids = [tok.eos_id, *tok.encode(TEXT + "?")]  # "?" is not in the vocabulary
    assert fast(TEXT + "?", add_special_tokens=False)["input_ids"] == ids[1:]
    assert fast.decode(ids, skip_special_tokens=True) == tok.decode(ids) == TEXT
    chat = fast.apply_chat_template(
        [{"role": "user", "content": TEXT}], add_generation_prompt=True, tokenize=False
    )
    assert fast(chat, add_special_tokens=False)["input_ids"] == ids[:-1]  # EOS + the text
    with torch.no_grad():
        x = torch.tensor([ids])
        diff = (model(x) - llama(x).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_moe_and_byte_runs_are_not_exported_and_say_why():
    moe = DecoderConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, moe={"n_experts": 2})
    assert "model.moe" in why_not_exportable(moe, CharTokenizer(["a"]))
    from meshtrain.data.tokenizer import as_tokenizer

    dense = DecoderConfig(vocab_size=512, dim=32, n_layers=1, n_heads=2)
    assert "data.tokenizer='byte'" in why_not_exportable(dense, as_tokenizer("byte"))
