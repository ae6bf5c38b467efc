"""The training loop of :class:`~meshtrain.trainer.Trainer` (``train`` and what it
calls at each step: logging, evaluation, best-model tracking, checkpoints, the end).

A mixin so the Trainer module stays small; it uses the Trainer's attributes (``args``,
``state``, ``control``, ``engine``, ``topology``, callbacks) and methods
(``training_step``, ``evaluate``, ``log``, ``_event``, ``_say``).

Epochs and windows: an epoch is one pass of the resumable loader; an optimizer step takes
the next ``gradient_accumulation_steps`` micro-batches (fewer at the end of an epoch).
Resuming loads the engine checkpoint (model, optimizer, schedule, RNG, data position) and
the ``TrainerState`` saved in it, and continues in the epoch and at the sample where the
checkpoint was taken; a ``checkpoint-N/`` the transformers Trainer wrote is resumed by
``transformers_resume`` (its files, transformers' data-skipping rule and RNG points).
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import torch

from meshtrain.errors import ConfigError
from meshtrain.files.writable import check_writable
from meshtrain.interop.trainer_source import is_trainer_checkpoint
from meshtrain.trainer import checkpoints as ckpt
from meshtrain.trainer.callbacks import RunLogCallback
from meshtrain.trainer.report import end_table, training_header
from meshtrain.trainer.state import TrainerControl, TrainerState, TrainOutput, exported_states
from meshtrain.trainer.transformers_resume import resume_from_transformers


class TrainingLoop:
    """``train()`` and its helpers (see the module docstring)."""

    def train(
        self,
        resume_from_checkpoint: bool | str | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Train to ``max_steps`` / ``num_train_epochs``; see the module docstring."""
        if self.train_dataset is None:
            raise ConfigError("Trainer.train() needs train_dataset=")
        from meshtrain.distributed import comm

        args = self.args
        if args.save_strategy != "no":  # before any work: a run must not end at its first save
            check_writable(self.checkpoint_dir, ConfigError, what="TrainingArguments.output_dir")
        self._setup()
        engine, loader = self.engine, self.train_dataloader
        resume = resume_from_checkpoint
        if resume is None:
            resume = args.resume_from_checkpoint
        path = ckpt.resolve_resume(resume, self.checkpoint_dir, self.checkpoint_prefix)
        epoch_done, restore_rng, skips = False, None, False
        if path is not None and is_trainer_checkpoint(path):  # transformers wrote it
            self.state, restore_rng, skips = resume_from_transformers(
                engine,
                loader,
                path,
                steps_per_epoch=self.steps_per_epoch,
                gas=args.gradient_accumulation_steps,
                per_device=args.per_device_train_batch_size,
                topology=self.topology,
                say=self._say,
            )
            self._say(f"resuming from {path} (transformers, step {self.state.global_step})")
        elif path is not None:
            _, client = engine.load_checkpoint(str(path.parent), tag=path.name)
            self.state = TrainerState.from_dict(client.get("trainer_state", {}))
            epoch_done = bool(client.get("epoch_done"))
            self._say(f"resuming from {path} (step {self.state.global_step})")
        st = self.state
        st.max_steps, st.num_train_epochs = self.max_steps, self.num_epochs
        st.compute_steps(args, self.max_steps)  # transformers': an unset one keeps 500
        st.train_batch_size = args.per_device_train_batch_size
        st.is_world_process_zero = self.topology.rank == 0
        start_step = self.start_step = st.global_step
        self._say(
            training_header(
                num_examples=len(self.train_dataset),
                num_epochs=self.num_epochs,
                per_device=args.per_device_train_batch_size,
                total_batch=engine.config.train_batch_size,
                accumulation=args.gradient_accumulation_steps,
                max_steps=self.max_steps,
                num_params=self.num_parameters,
                processes=self.topology.world_size,
                zero_stage=engine.zero_stage,
                precision=engine.config.precision,
                tensor_parallel=self.topology.tp_size,
                pipeline_parallel=self.topology.pp_size,
            )
        )
        if engine.preemption is not None:
            engine.preemption.auto = False  # this loop saves its own state with the step
        self.control = TrainerControl()
        if path is not None and args.restore_callback_states_from_checkpoint:
            self._restore_callback_states()
        if path is None:  # transformers' new TrainerState holds them from the start
            st.stateful_callbacks = exported_states(
                [*self.callback_handler.callbacks, self.control]
            )
        # every module, once: training_step only checks the top flag, and a peft wrapper
        # says training while the from_pretrained model inside it is in eval mode
        self.model.train()
        self.control = self._event("on_train_begin")
        t0 = time.perf_counter()
        run_loss = torch.zeros((), device=engine.device)  # this run's summed step shares
        log_loss = torch.zeros((), device=engine.device)
        log_steps, self._last_eval = 0, None
        sampler = loader.sampler
        start_epoch = int(sampler.epoch) if path is not None else 0
        if path is not None and epoch_done and sampler.consumed >= len(self.train_dataset):
            start_epoch += 1
        n_rows = len(self.train_dataset)
        dp = self.topology.dp_size  # each rank's share is x dp: the sum over ranks / dp
        for epoch in range(start_epoch, self.num_epochs):
            if st.global_step >= self.max_steps or self.control.should_training_stop:
                break
            loader.set_epoch(epoch)
            if restore_rng is not None and not skips:  # transformers' points (transformers_resume)
                restore_rng()
            batches = iter(loader)
            self.control = self._event("on_epoch_begin")
            while st.global_step < self.max_steps:
                window = list(itertools.islice(batches, args.gradient_accumulation_steps))
                if not window:
                    break
                if restore_rng is not None:
                    restore_rng()  # once: after the first window of a skipping resume
                self.control = self._event("on_step_begin")
                share, local_mean = self._run_window(window)
                if args.logging_nan_inf_filter and not bool(torch.isfinite(share)):
                    # transformers' filter: a NaN / inf step counts as this process's mean
                    # of the steps since the last log (per step here; per micro-batch there)
                    share = log_loss / (1 + log_steps)
                if engine.log.last and local_mean is not None:
                    engine.log.last["loss"] = local_mean  # rank 0's item mean
                if engine.log.last.get("flops") is not None:  # known for known model shapes
                    st.total_flos += engine.log.last["flops"]
                run_loss += share
                log_loss += share
                log_steps += 1
                st.global_step += 1
                st.epoch = epoch + min(1.0, sampler.consumed / max(1, n_rows))
                self.control = self._event("on_step_end")
                if self.control.should_log and log_steps:
                    comm.all_reduce(log_loss, self.topology.dp_group, label="control")
                    self._log_train(float(log_loss) / dp / log_steps)
                    log_loss.zero_()
                    log_steps = 0
                self._evaluate_and_save(ignore_keys_for_eval, epoch_done=False)
                self._preemption_point()
                if self.control.should_training_stop or self.control.should_epoch_stop:
                    break
            self.control.should_epoch_stop = False
            # transformers fires on_epoch_end (and its log / evaluate / save) also when
            # training stops inside the epoch; the epoch then is not done
            stopped = st.global_step >= self.max_steps or self.control.should_training_stop
            epoch_done = not (stopped and sampler.consumed < n_rows)
            if epoch_done:
                st.epoch = float(epoch + 1)
            self.control = self._event("on_epoch_end")
            if self.control.should_log and log_steps:
                comm.all_reduce(log_loss, self.topology.dp_group, label="control")
                self._log_train(float(log_loss) / dp / log_steps)
                log_loss.zero_()
                log_steps = 0
            self._evaluate_and_save(ignore_keys_for_eval, epoch_done=epoch_done)
            if not epoch_done:
                break
        return self._finish_training(run_loss, start_step, t0)

    def _restore_callback_states(self) -> None:
        """transformers' ``_load_callback_state``: each saved ``ExportableState`` whose
        class the Trainer has again is rebuilt from its saved state (instances of one
        class in order); saved ones the Trainer lacks are named in a warning."""
        import warnings

        current = [*self.callback_handler.callbacks, self.control]
        missing = []
        for name, data in self.state.stateful_callbacks.items():
            saved = data if isinstance(data, list) else [data]
            same = [c for c in current if type(c).__name__ == name]
            if not same:
                missing.append(name)
                continue
            for old, state in zip(same, saved, strict=False):
                new = type(old).from_state(state)
                if isinstance(old, TrainerControl):
                    self.control = new
                else:
                    i = self.callback_handler.callbacks.index(old)
                    self.callback_handler.callbacks[i] = new
        if missing:
            warnings.warn(
                "the checkpoint holds the state of callbacks this Trainer does not have; "
                f"ignored: {', '.join(missing)}",
                stacklevel=3,
            )

    def _log_train(self, loss: float) -> None:
        grad_norm = self.engine.get_global_grad_norm()
        self.log(
            {
                "loss": loss,
                "grad_norm": grad_norm if grad_norm is not None else float("nan"),
                "learning_rate": self._applied_lr,
            }
        )

    def _evaluate_and_save(self, ignore_keys: list[str] | None, epoch_done: bool) -> None:
        metrics = None
        if self.control.should_evaluate:
            metrics = self.evaluate(ignore_keys=ignore_keys)
            self._update_best(metrics)
            self.control.should_evaluate = False
        if self.control.should_save or (
            self.args.save_strategy == "best" and metrics is not None and self._improved
        ):
            if self.args.save_strategy != "best" or (metrics is not None and self._improved):
                self._save_checkpoint(epoch_done)
            self.control.should_save = False
        self.control.should_log = False

    def _update_best(self, metrics: dict[str, float]) -> None:
        self._improved = False
        key = self.args.metric_key
        if key is None:
            return
        if key not in metrics:
            raise ConfigError(
                f"TrainingArguments.metric_for_best_model={self.args.metric_for_best_model!r}: "
                f"the evaluation returned no {key!r}; available: {sorted(metrics)}. Use one of "
                "those names (without the eval_ prefix) or return it from compute_metrics"
            )
        value = float(metrics[key])
        if ckpt.is_better(value, self.state.best_metric, bool(self.args.greater_is_better)):
            self.state.best_metric = value
            self.state.best_global_step = self.state.global_step
            self._improved = True

    def _save_checkpoint(self, epoch_done: bool) -> None:
        """``output_dir/checkpoint-<step>`` (see ``meshtrain.trainer.checkpoints``)."""
        from meshtrain.accelerate.peft_io import is_peft_model, prompt_embeddings

        st, args, engine = self.state, self.args, self.engine
        root, prefix = self.checkpoint_dir, self.checkpoint_prefix
        tag = f"{prefix}{st.global_step}"
        if st.best_global_step == st.global_step:
            st.best_model_checkpoint = os.path.join(root, tag)
        st.stateful_callbacks = exported_states([*self.callback_handler.callbacks, self.control])
        client = {"trainer_state": st.to_dict(), "epoch_done": epoch_done}
        # a synchronous save runs ``beside`` on every rank at once: the ranks write the
        # weights from their shards; an asynchronous one runs it in the background, where
        # no collective may run, so the whole weights are gathered now (as a peft adapter's)
        from_ranks = not engine.config.checkpoint.async_save and not is_peft_model(self.model)
        state_dict = None if from_ranks else engine.module_state_dict()  # every rank: whole
        prompts = prompt_embeddings(engine, self.model)  # ZeRO-3 prompt tuning: all ranks
        snapshot = TrainerState.from_dict(st.to_dict())  # an async write runs on after this

        def beside(path) -> None:  # after the commit (in the background under async_save)
            if from_ranks:
                engine.save_weights(path)  # collective: each file from the ranks holding it
            if self.topology.rank == 0:
                # transformers' files beside the shards: the model (``from_pretrained`` loads
                # the folder), the tokenizer / processor, the arguments as JSON, the state
                if from_ranks:
                    self._export_files(path)
                else:
                    self._export(path, state_dict, prompts)
                self._write_args(path)
                snapshot.save_to_json(path / "trainer_state.json")
                best = ckpt.step_of(snapshot.best_model_checkpoint, prefix)
                steps = ckpt.checkpoint_steps(root, prefix)
                ckpt.delete(root, ckpt.to_delete(steps, args.save_total_limit, best), prefix)

        self.last_checkpoint = (
            st.global_step,
            engine.save_checkpoint(root, tag=tag, client_state=client, on_commit=beside),
        )
        self._barrier()
        self.control = self._event("on_save")

    def _preemption_point(self) -> None:
        """Every rank together: a SIGTERM/SIGUSR1 any rank caught (``checkpoint.
        save_on_preemption``) saves this step (unless just saved) and exits with code 75."""
        guard = self.engine.preemption
        if guard is None or not guard.requested(self.topology.group("world")):
            return
        from meshtrain.engine.preemption import preempt

        step, path = getattr(self, "last_checkpoint", (None, None))
        if step != self.state.global_step:
            self._save_checkpoint(epoch_done=False)
            step, path = self.last_checkpoint
        self.engine.wait_for_checkpoint()
        raise preempt(step, path, guard.late_by)

    def _finish_training(self, run_loss: torch.Tensor, start_step: int, t0: float) -> TrainOutput:
        from meshtrain.distributed import comm

        st, args = self.state, self.args
        self.engine.wait_for_checkpoint()  # an asynchronous save is committed on return
        comm.all_reduce(run_loss, self.topology.dp_group, label="control")
        steps = max(1, st.global_step - start_step)
        train_loss = float(run_loss) / self.topology.dp_size / steps
        if args.load_best_model_at_end and st.best_model_checkpoint:
            best = ckpt.resolve_resume(st.best_model_checkpoint, self.checkpoint_dir)
            if best is not None and best.is_dir():
                self._say(f"Loading best model from {best} (score: {st.best_metric}).")
                self.engine.load_checkpoint(str(best.parent), tag=best.name, load_module_only=True)
        if args.save_total_limit == 1 and st.best_model_checkpoint and self.topology.rank == 0:
            # transformers: with a limit of 1 only the best checkpoint outlives training
            best = ckpt.step_of(st.best_model_checkpoint, self.checkpoint_prefix)
            saved = ckpt.checkpoint_steps(self.checkpoint_dir, self.checkpoint_prefix)
            others = [s for s in saved if s != best] if best in saved else []
            ckpt.delete(self.checkpoint_dir, others, self.checkpoint_prefix)
        self._barrier()
        self._sync_user_model()
        runtime = time.perf_counter() - t0
        samples = steps * self.engine.config.train_batch_size
        metrics = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(samples / runtime, 3),
            "train_steps_per_second": round(steps / runtime, 3),
            # the engine's model FLOPs (MFU's count); left out where it knows none
            **({"total_flos": st.total_flos} if "flops" in self.engine.log.last else {}),
            "train_loss": train_loss,
        }
        self.log(metrics)  # adds the epoch to the metrics returned, as transformers' does
        self.control = self._event("on_train_end")
        logger = next(
            (c for c in self.callback_handler.callbacks if isinstance(c, RunLogCallback)), None
        )
        self.run_log_rows = [] if logger is None else logger.rows
        table = end_table(st.log_history)
        if table:
            self._say(table)
        return TrainOutput(st.global_step, train_loss, metrics)

    def _sync_user_model(self) -> None:
        """Give the user's model object the whole trained weights on every rank: under
        ZeRO-3 its parameters are shards between steps (gathered, hooks removed); under
        tensor parallelism its layers are tensor-parallel ones (the original modules go
        back, holding the gathered, unpadded weights; ``parallel.tensor.restore``); under
        pipeline parallelism the blocks the split freed get the trained weights back
        (``PipelineSteps.restore_user_model``), first, so that under pp x tp each rank has
        its tp rank's shards of every block before they are gathered. Evaluation and
        prediction then run the whole model on every rank (under pp alone they keep running
        through the pipeline)."""
        self._handed_back = True  # the engine's shards no longer map the model's tensors
        self.engine.zero.release_module(self.engine.module)
        if self._pipeline is not None:  # other stages' blocks: weights back
            # under tp too: each rank receives its own tp rank's shards (the pp group
            # holds one tp rank), so the un-sharding below then has every block's shards
            self._pipeline.restore_user_model()
        if self.topology.tp_size > 1:
            from meshtrain.parallel.tensor.restore import remove_tensor_parallel

            # on the user's model: tensor parallelism was applied to it whole, before a split
            remove_tensor_parallel(self.model, self.topology.tp_group)
            self._gather_vocab = None  # the logits are whole now
            self._whole_model = self._pipeline is not None


__all__ = ["TrainingLoop"]
