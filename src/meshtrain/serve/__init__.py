"""Serving what was trained: ``meshtrain serve MODEL`` (``docs/serve.md``).

``loading`` resolves MODEL (save_pretrained folder, sharded meshtrain checkpoint, Trainer
checkpoint) into a model and tokenizer; ``app`` is the FastAPI application; ``batching``
batches concurrent classification requests; ``generation`` runs chat generation on a
worker thread with a bounded queue; ``chat`` and ``classify`` hold the model calls.
Nothing heavy is imported here: ``fastapi``/``transformers`` load with the submodules.
"""
