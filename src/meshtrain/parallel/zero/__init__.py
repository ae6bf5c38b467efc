"""Everything that owns data-parallel gradient and optimizer storage, ZeRO stages 0-3.

One package because one concern: where a parameter's gradient, its fp32 master and its
optimizer state live across the data-parallel group, and how they get there. Stage 0
(plain DP) is the same storage with nothing sharded, so it lives here too.

* ``flat_group`` - flat buffers: buckets, per-rank chunks, shards, fp32 masters
* ``grad_reducer`` - bucketed gradient reduction overlapped with backward
* ``plan`` - the per-stage storage plan, its byte table and ``comm_bytes_theory``
* ``stage`` - the ZeRO stage the Engine calls: the lifecycle and the gradient contract
* ``part`` - one kind of parameters (the model's, or its experts') over its replicas
* ``gatherers`` - stage 3: both parts' gatherers behind one face
* ``stage3`` / ``gather_ahead`` - stage-3 unit gathering, prefetch and freeing
* ``frozen`` - frozen (e.g. LoRA base) parameters under every stage
* ``partition`` - parameters partitioned at construction (``meshtrain.zero.Init``; the
  user-facing API is ``meshtrain.deepspeed_zero``)
"""
