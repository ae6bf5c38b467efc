"""The trained model as a ``transformers`` folder, so ``meshtrain serve OUTPUT_DIR`` serves it.

``meshtrain serve`` runs ``transformers`` causal LMs (``model.generate``, its paged cache),
so at the end of a run rank 0 writes ``<output_dir>/model/`` with ``save_pretrained``:
the reference decoder as a ``LlamaForCausalLM`` and the job's tokenizer as a fast
tokenizer. ``meshtrain serve`` finds that folder when it is given the output directory.

The decoder *is* a Llama (pre-norm RMSNorm blocks, rotary attention without biases,
SwiGLU MLP, optionally tied embeddings), with one difference in layout: meshtrain rotates
the pairs ``(x[2i], x[2i+1])`` of each head, Llama rotates ``(x[i], x[i + hd/2])``. Both use
frequency ``theta^(-2i/hd)`` for pair ``i``, so reordering the rows of each head of
``q_proj`` and ``k_proj`` (even rows first, then odd) turns one into the other: scores
``q . k`` are sums over the same products in another order. Weight names map one to one
(``embed`` -> ``model.embed_tokens``, ``layers.N.attn`` -> ``model.layers.N.self_attn``,
``attn_norm`` -> ``input_layernorm``, ``mlp_norm`` -> ``post_attention_layernorm``).
Not exported, with the reason printed instead of a serve command: MoE blocks (no Llama
equivalent) and the ``byte`` tokenizer.

The char tokenizer becomes a ``tokenizers`` WordLevel model over the same ids, splitting
text into single characters and joining them back without spaces (``decoders.Fuse``).
Its chat template is the plain text of the conversation after an EOS, the way the model
was trained: this is a language model of news text, not a chat model, so a chat request
gets a continuation of what was sent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from meshtrain.files.atomic import atomic_path

EXPORT_DIR = "model"
CHAT_TEMPLATE = (
    "{{ eos_token }}{% for m in messages %}{% if m['role'] != 'system' %}"
    "{{ m['content'] }}{% endif %}{% endfor %}"
)


def why_not_exportable(decoder_config: Any, tokenizer: Any) -> str | None:
    """The reason this run cannot be served, or None."""
    import importlib.util

    if decoder_config.moe is not None:
        return (
            "model.moe: a mixture-of-experts decoder has no transformers Llama equivalent "
            "to export, so meshtrain serve cannot load it"
        )
    if getattr(tokenizer, "name", None) != "char":
        return (
            f"data.tokenizer={getattr(tokenizer, 'name', tokenizer)!r}: only the char "
            "tokenizer is exported for serving"
        )
    if importlib.util.find_spec("transformers") is None:
        return 'transformers is not installed; pip install "meshtrain[hf,serve]" and train again'
    return None


def llama_state_dict(state: dict[str, torch.Tensor], n_heads: int) -> dict[str, torch.Tensor]:
    """The decoder's weights under Llama's names and rotary layout (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        t = tensor.detach().cpu().contiguous()
        if name.endswith(("attn.q_proj.weight", "attn.k_proj.weight")):
            rows, cols = t.shape
            hd = rows // n_heads
            # per head: rows 0, 2, 4, ... then 1, 3, 5, ...
            t = t.view(n_heads, hd // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
        new = (
            name.replace("embed.", "model.embed_tokens.", 1)
            .replace("layers.", "model.layers.", 1)
            .replace(".attn_norm.", ".input_layernorm.")
            .replace(".mlp_norm.", ".post_attention_layernorm.")
            .replace(".attn.", ".self_attn.")
        )
        if name == "norm.weight":
            new = "model.norm.weight"
        out[new] = t.contiguous()
    return out


def llama_config(cfg: Any, tokenizer: Any):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        architectures=["LlamaForCausalLM"],
    )


def char_tokenizer_fast(tokenizer: Any, context: int):
    """The job's CharTokenizer as a ``PreTrainedTokenizerFast`` with the same ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from meshtrain.jobs.train.corpus import SPECIALS

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i, ch in enumerate(tokenizer.chars):
        vocab.setdefault(ch, i + len(SPECIALS))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=context,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def export_for_serving(model: torch.nn.Module, tokenizer: Any, output_dir: str | Path) -> Path:
    """Write ``<output_dir>/model`` (module docstring) atomically; returns its path.
    Call :func:`why_not_exportable` first."""
    from transformers import GenerationConfig, LlamaForCausalLM

    cfg = model.config
    folder = Path(output_dir) / EXPORT_DIR
    llama = LlamaForCausalLM(llama_config(cfg, tokenizer))
    weights = llama_state_dict(model.state_dict(), cfg.n_heads)
    if cfg.tie_embeddings:
        weights.pop("lm_head.weight", None)
    missing, unexpected = llama.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:  # a decoder change this mapping does not know yet
        raise RuntimeError(
            f"export to Llama: missing {missing[:4]}, unexpected {unexpected[:4]}; "
            "update meshtrain/jobs/train/serving_export.py's name map"
        )
    llama.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    with atomic_path(folder) as tmp:  # a reader sees the old export or the new, never half
        llama.save_pretrained(tmp)
        char_tokenizer_fast(tokenizer, cfg.max_seq_len).save_pretrained(tmp)
        (tmp / "meshtrain_export.json").write_text(
            json.dumps({"from": "meshtrain train", "decoder": cfg.to_dict()}, default=str),
            encoding="utf-8",
        )
    return folder


__all__ = [
    "CHAT_TEMPLATE",
    "EXPORT_DIR",
    "char_tokenizer_fast",
    "export_for_serving",
    "llama_config",
    "llama_state_dict",
    "why_not_exportable",
]
