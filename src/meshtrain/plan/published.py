"""Published GPU runs beside the planner's prediction of their layouts (docs/plan.md,
"Against published runs"): pure arithmetic on data-sheet H100s, no measurement.
``python -m meshtrain.plan.proof published [--search]`` prints the table; ``--search`` adds
the planner's own top 3 on the same devices.
"""

from __future__ import annotations

from meshtrain.plan.layout import Layout

__all__ = ["PUBLISHED", "predict_published"]

L = Layout
LLAMA3_8B = (
    "decoder:dim=4096,n_layers=32,n_heads=32,ffn_dim=14336,vocab_size=128256,max_seq_len=8192"
)
# GQA (8 kv heads) is not a field of the reference decoder: its attention keeps 32 kv heads,
# which changes the parameters by 1% and the activations a little
LLAMA31_405B = ("decoder:dim=16384,n_layers=126,n_heads=128,ffn_dim=53248,vocab_size=128256,"
                "max_seq_len=8192")  # fmt: skip
DEEPSEEK_V3 = {  # MLA is modelled as plain multi-head attention; 3 dense layers as MoE
    "vocab_size": 129280, "dim": 7168, "n_layers": 61, "n_heads": 128, "ffn_dim": 18432,
    "max_seq_len": 4096,
    "moe": {"n_experts": 256, "top_k": 8, "n_shared_experts": 1, "expert_ffn_dim": 2048,
            "routing": "sigmoid_topk"},
}  # fmt: skip

PUBLISHED = (
    # name, model, gpus, nodes, seq, global batch, layout, published tokens/s per GPU, source
    ("Llama-3-8B, 8 x H100, torchtitan (FSDP, AC)", LLAMA3_8B, 8, 1, 8192, 8,
     L(dp=8, stage=3, micro_batch=1, grad_accum=1, checkpointing=True), 6667,
     "torchtitan README / TorchTitan paper, bf16"),
    ("Llama-3.1-405B, 512 x H100, torchtitan (FSDP 8, TP 8, PP 8)", LLAMA31_405B, 512, 64, 8192,
     256, L(dp=8, tp=8, pp=8, stage=1, sequence_parallel=True, schedule="interleaved_1f1b",
            virtual_stages=2, micro_batch=1, grad_accum=32, checkpointing=True), 128,
     "TorchTitan paper (3D, bf16); meshtrain runs ZeRO-1 instead of FSDP under a pipeline"),
    ("Llama-3.1-405B, 1,024 x H100, Megatron (TP 8, PP 16)", LLAMA31_405B, 1024, 128, 8192,
     1024, L(dp=8, tp=8, pp=16, stage=1, sequence_parallel=True, schedule="interleaved_1f1b",
             virtual_stages=2, micro_batch=1, grad_accum=128, checkpointing=True), None,
     "no figure in issue 43; predicted only"),
    ("DeepSeek-V3, 1,024 x H100, Megatron (PP 16, EP 64)", DEEPSEEK_V3, 1024, 128, 4096, 8192,
     L(dp=64, pp=16, ep=64, stage=1, micro_batch=1, grad_accum=128, checkpointing=True), 1297,
     "Megatron-Core DeepSeek-V3 recipe as quoted in issue 43; layout assumed (see docs)"),
)  # fmt: skip


def predict_published(rows=PUBLISHED, *, search: bool = False, echo=print) -> list[dict]:
    """Each published layout's predicted tokens/s per GPU beside the published figure;
    with ``search`` also the planner's own top 3 on the same devices."""
    from meshtrain.plan.hardware import Hardware
    from meshtrain.plan.model_facts import ModelFacts, load_model
    from meshtrain.plan.planner import Planner

    out = []
    for name, spec, gpus, nodes, seq, batch, layout, published, source in rows:
        if isinstance(spec, dict):
            import torch

            from meshtrain.models import Decoder, DecoderConfig

            with torch.device("meta"):
                model = Decoder(DecoderConfig(**spec))
        else:
            model = load_model(spec)
        facts = ModelFacts.of(model)
        hw = Hardware.named("H100", gpus_per_node=gpus // nodes)
        planner = Planner(facts, hw, gpus=gpus, seq=seq, global_batch=batch, limit=hw.memory_bytes)
        why = planner.refusal(layout)
        pred = planner.predict(layout)
        row = {
            "run": name, "layout": layout.label(), "refused": why,
            "predicted": pred.tokens_per_s, "published": published,
            "memory_gib": pred.memory.total / 2**30, "fits": pred.fits, "mfu": pred.mfu,
            "bottleneck": pred.bottleneck, "source": source,
        }  # fmt: skip
        if search:
            top = [p for p in planner.ranked() if p.fits][:3]
            row["top3"] = [(p.layout.label(), p.tokens_per_s) for p in top]
        out.append(row)
        err = "" if not published else f" ({100 * (pred.tokens_per_s / published - 1):+.0f}%)"
        echo(f"{name}: {layout.label()}: predicted {pred.tokens_per_s:,.0f} tok/s/GPU, published "
             f"{published or '-'}{err}, {row['memory_gib']:.1f} GiB, MFU {100 * pred.mfu:.1f}%, "
             f"{pred.bottleneck}" + (f", REFUSED: {why}" if why else ""))  # fmt: skip
        if search:
            echo(f"  planner's top 3: {row['top3']}")
    return out
