"""``meshtrain train``, the main job: one command from a real corpus to a trained model.

Modules (each imported only when used, so ``import meshtrain`` stays light):
``main_job`` (the command: config, data, launch), ``job_config`` (the default config and
its ``train``/``model``/``data`` sections, overrides), ``corpus`` (the shipped news text,
its held-out split, the character tokenizer, the token stores), ``loop`` (one rank:
engine, resume, the Trainer, the end of the run), ``heldout`` (the token-weighted
held-out loss over the ranks) and ``heldout_callback`` (when it runs), ``sample`` (the
generated text), ``serving_export`` (the model as a transformers folder for
``meshtrain serve``), ``plot`` (loss.png), ``summary`` (loss, held-out loss, throughput,
memory and bytes communicated against theory, the sample, the serve command) and
``run_lock`` (one run per output folder). The progress bar, JSONL and TensorBoard writer
are the Trainer's (``meshtrain.trainer.run_log``). See docs/train.md.
"""
