"""``meshtrain train``, the main job: one command from a real corpus to a trained model.

Modules (each imported only when used, so ``import meshtrain`` stays light):
``main_job`` (the command: config, data, launch), ``job_config`` (the default config and
its ``train``/``model``/``data`` sections, overrides), ``corpus`` (the shipped news text,
the character tokenizer, the token store), ``loop`` (one rank: engine, resume, the loop,
checkpoints), ``run_log`` (progress bar, JSONL, TensorBoard, loss plot) and ``summary``
(loss, throughput, memory and bytes communicated against theory). See docs/train.md.
"""
