"""Host RAM per rank while a layout loads: from building the model to the first step.

A user's script builds the whole model in every process (``Model(config)`` or
``from_pretrained``, fp32 unless it asks otherwise) and hands it to
``meshtrain.initialize``. What one rank holds resident passes three peaks, in order:

1. **Build**: the whole model, ``M = 4 P`` bytes, plus what its initialisation holds for
   a moment. meshtrain's Decoder draws each parameter as ``randn(shape) * std`` before it
   copies it in (``Decoder.reset_parameters``): two temporaries the size of the largest
   parameter. transformers' models initialise in place (``_init_weights``): none.
2. **Wrap**: ``parallelize`` first cuts tensor-parallel shards, this rank's pipeline
   stages and its experts, freeing the rest (tensor-parallel shards replace each
   parameter as they are cut; the expert shards of all layers are made while the whole
   experts are still alive, so under ep the cut itself peaks at ``M`` plus this rank's
   ``1/ep`` of the experts), and the rank keeps ``R`` bytes (its
   parameters unpartitioned, in fp32); then ZeRO allocates its flat parameter storage
   ``F`` and copies every parameter in before the originals go (``FlatGroup``): ``R`` for
   stages 0-2, the ``1/(dp cp)`` partition at stage 3 (offloaded or not, it is host RAM on
   CPU ranks). Under bf16/fp16 ``F`` is in that width and the fp32 master partition is
   allocated beside it. The gradient storage is allocated but not written, so it is not
   resident until the first backward (``FlatGroup._init_grads``).
3. **Settled**: the rank's flat parameters ``F`` (plus masters) and the code
   ``initialize`` loads (below).

Code is resident memory too, and at these sizes it is not small (measured per rank on
this machine, torch 2.14.1 and transformers 5.24; ``tests/plan/test_host_memory.py``
measures them again): the first ``torch.optim`` optimizer, or the first transformers model
class, imports ``torch._dynamo`` (``DYNAMO_IMPORT``, 155 MB); a transformers model class
brings 118 MB more of its own (``TRANSFORMERS_IMPORT``, imported before the model is
built, so it sits under every peak); ``initialize`` loads 23 MB of meshtrain's modules
(``INITIALIZE_IMPORT``). ``Hardware.host_overhead_bytes`` adds what the device runtime
keeps on the host (nothing for CPU ranks).

**Sliced loading** (``meshtrain.from_pretrained(folder, config=...)``, ``sliced=True``): the
model is built on untouched storage (``no_init_weights``: the kernel backs no page), the
layout is applied to it without copying values, and each rank then reads only the
element ranges it keeps, one range at a time. Nothing of the whole model becomes
resident: *build* is the code alone (transformers' model class, and the ``torch._dynamo``
it imports), *wrap* is ``F`` (plus the fp32 masters under bf16/fp16) as the slices land
in it, plus the code; the read range itself is a few MiB (measured 3.6 MiB on a 642 MiB
Llama at ZeRO-3 on 2 ranks, where every rank held its 321 MiB slice and 280 MiB of code).
Only the transformers families load this way.

**Under** ``meshtrain.zero.Init`` (ZeRO-3): every module's parameters are partitioned as
its constructor returns, so the *build* holds the partitions made so far (``F`` at the
end) plus one parameter whole with what its initialisation holds: its gathered copy and
the Decoder's two ``randn * std`` temporaries, ``4 x`` the largest parameter (measured:
183 MiB on 2 ranks and 127 MiB on 4 for a 226 MiB decoder whose largest parameter is
16.5 MiB; predicted 179 and 122). ``initialize`` then moves the shards into ``F`` one by
one, so *wrap* is ``F`` plus code (measured 288 and 232 MiB, predicted 283 and 226). A
transformers model under the context is partitioned only when its outermost constructor
returns (``deepspeed_zero``'s docstring): its peaks are those of the whole build.

The peak is the largest of the three; the optimizer's states come at the first step and
belong to the training peak, not here. On a GPU the wrap and later phases happen in device
memory once the model moves there, so the host peak is the build plus what offload keeps
on the host (not measured: no GPU on this machine). A node holds one such peak per rank
it runs. Not predicted: glibc's heap of blocks under its mmap threshold (about 20 MB per
rank here), which is why measured peaks run a few percent above the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshtrain.plan.hardware import Hardware
from meshtrain.plan.layout import Layout
from meshtrain.plan.memory import model_states
from meshtrain.plan.model_facts import ModelFacts
from meshtrain.plan.validity import LayoutCheck

__all__ = ["LOADINGS", "HostLoad", "predict_host_load"]

# how a script loads its model (docstring): built whole in every process, read sliced by
# meshtrain.from_pretrained(folder, config=...), or built under meshtrain.zero.Init
LOADINGS = ("whole", "sliced", "zero-init")

FP32 = 4
DYNAMO_IMPORT = 155 * 10**6
TRANSFORMERS_IMPORT = 118 * 10**6
INITIALIZE_IMPORT = 23 * 10**6


@dataclass(frozen=True)
class HostLoad:
    """Resident host bytes of the largest rank at each peak of the module docstring."""

    build: int
    wrap: int
    settled: int
    ranks_per_node: int

    @property
    def peak(self) -> int:
        return max(self.build, self.wrap, self.settled)

    @property
    def phase(self) -> str:
        """Which of the three decides the peak."""
        return max(("build", self.build), ("wrap", self.wrap), ("settled", self.settled),
                   key=lambda kv: kv[1])[0]  # fmt: skip

    @property
    def per_node(self) -> int:
        return self.peak * self.ranks_per_node


def build_transient(facts: ModelFacts) -> int:
    """Bytes a model's own initialisation holds beside its parameters (docstring, 1)."""
    return 2 * FP32 * facts.largest if facts.family == "decoder" else 0


def predict_host_load(
    facts: ModelFacts,
    layout: Layout,
    check: LayoutCheck,
    hw: Hardware,
    *,
    precision: str,
    optimizer: str,
    cache: dict | None = None,
    loading: str = "whole",
) -> HostLoad:
    """The module docstring's three peaks for ``layout`` on ``hw``; ``cache``: the
    planner's model-states cache (``plan.memory.model_states``); ``loading``: how the
    script loads the model, one of ``LOADINGS`` (module docstring)."""
    code = 0 if facts.family == "decoder" else DYNAMO_IMPORT + TRANSFORMERS_IMPORT
    settled_code = max(code, DYNAMO_IMPORT) + INITIALIZE_IMPORT + hw.host_overhead_bytes
    whole = FP32 * facts.params
    build = whole + build_transient(facts) + code
    cut = whole + FP32 * facts.expert_params // layout.ep + code if layout.ep > 1 else 0
    ranks = min(layout.world, hw.gpus_per_node)
    # each pp rank's own parameters, unpartitioned (stage 0) and in fp32: what the cut keeps
    resident = replace(layout, offload_param=False, offload_optimizer=False)
    kept = max(
        s.params
        for s in model_states(facts, replace(resident, stage=0), check, "fp32", optimizer, cache)
    )
    # ZeRO's flat parameter storage in the run's width (stage 3: the partition, with the
    # parameters it keeps whole); offloaded, the same bytes sit in host memory
    flat = max(s.params for s in model_states(facts, resident, check, precision, optimizer, cache))
    if precision != "fp32":
        replicas = layout.dp * layout.cp if layout.stage >= 1 else 1
        flat += -(-kept // replicas)  # the fp32 master partition (kept is already fp32)
    if hw.name != "cpu":  # wrap and settle in device memory; the host keeps what offload moves
        offloaded = flat if layout.offload_param else 0
        first = code if loading == "sliced" else build
        return HostLoad(first, offloaded + code, offloaded + settled_code, ranks)
    if loading == "sliced":  # nothing whole is ever resident: the slices land in F
        return HostLoad(code, flat + code, flat + settled_code, ranks)
    if loading == "zero-init" and facts.family == "decoder":
        # the partitions accumulate while one parameter at a time is whole, with its
        # initialisation's two temporaries and its gathered copy; the shards then move
        # into F one by one
        return HostLoad(flat + 4 * FP32 * facts.largest, flat + code, flat + settled_code, ranks)
    return HostLoad(build, max(cut, kept + flat + code), flat + settled_code, ranks)
