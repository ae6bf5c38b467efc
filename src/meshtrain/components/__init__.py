"""Mesh-free building blocks: what a model and a parallel mechanism both need, and which
knows nothing of a mesh, a process group or a model family.

* ``attention``: the one attention seam (``causal_attention``) that every causal
  self-attention meshtrain runs goes through, the Decoder's directly, transformers'
  families through their attention registry; context parallelism plugs in behind it.
* ``documents``: the document index of packed rows (``documents_from_positions``).
* ``kv_cache``: what a transformers key/value cache looks like (checkpointed blocks and
  predictions drop it).
* ``routing``: top-k routing of a mixture-of-experts router (which experts, what weight).

This package sits below ``models/`` (the reference models) and ``parallel/`` (the
mechanisms), so both import it and neither imports the other's insides for these;
``parallel/`` never imports ``meshtrain.models`` (tests/test_architecture.py). It imports
nothing of meshtrain but ``errors``.
"""
