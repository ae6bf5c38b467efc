"""One room per model family: what meshtrain knows of each, declared in one file.

A room (``room.Room``) is a frozen record: the family's tensor-parallel plans and block
rows, its pipeline layout, its context-parallel hook-up, its experts modules, whether its
packed rows are proven, and the sizes the estimator reads. ``rooms.ROOMS`` holds every
room; the parallel mechanisms (``parallel.tensor.plans``, ``parallel.tensor.layer_plans``,
``parallel.pipeline.split``, ``parallel.context.apply``, ``parallel.experts.shard``), the
packing check (``models.packed_batches``) and the estimator (``estimate.activations``)
read it instead of tables of their own.

This package sits below ``parallel/`` and ``models/``: it imports neither, naming
meshtrain's own classes by string (``meshtrain.models.decoder.Decoder``) and transformers'
by class name or ``model_type``. The records it defines (``TPPlan``, ``Layout``,
``BlockPlan``, ``ConfigNames``) are plain data; the code that carries them out lives with
the mechanisms. Adding a family: docs/architecture.md, "Adding a family".
"""
