"""The training loop of :class:`~meshtrain.trainer.Trainer` (``train`` and what it
calls at each step: logging, evaluation, best-model tracking, checkpoints, the end).

``TrainingLoop`` is an object the Trainer builds and holds (``trainer.loop``). It holds
the Trainer and calls back through it for every step a user may override:
``trainer.training_step`` per micro-batch (which runs ``compute_loss``),
``trainer.evaluate`` and ``trainer.log``, so a subclass's methods run exactly as in
transformers' own loop. It reads the Trainer's public members (``args``, ``state``,
``control``, ``engine``, ``topology``, ``callback_handler``, ``saver``, ...) and changes
the Trainer only through its methods (``fire_event``, ``set_state``, ``set_control``,
``hand_back_model``); what only the loop needs (the learning rate the last step used,
whether the last evaluation improved, the last checkpoint) is the loop's own.

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
from meshtrain.trainer.loss import window_items
from meshtrain.trainer.report import end_table, training_header
from meshtrain.trainer.saving import barrier
from meshtrain.trainer.state import TrainerControl, TrainerState, TrainOutput, exported_states
from meshtrain.trainer.transformers_resume import resume_from_transformers


class TrainingLoop:
    """``train()`` and what it calls at each step, for one Trainer (module docstring)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.start_step = 0  # the step this run of train() began at (resumed or 0)
        self.applied_lr = 0.0  # the learning rate the last optimizer step used (logged)
        self.improved = False  # the last evaluation improved metric_for_best_model
        self.last_checkpoint: tuple[int, Any] | None = None  # (step, path) of the last save

    def train(
        self,
        resume_from_checkpoint: bool | str | None = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """Train to ``max_steps`` / ``num_train_epochs``; see the module docstring."""
        trainer = self.trainer
        if trainer.train_dataset is None:
            raise ConfigError("Trainer.train() needs train_dataset=")
        from meshtrain.distributed import comm

        args = trainer.args
        if args.save_strategy != "no":  # before any work: a run must not end at its first save
            check_writable(trainer.checkpoint_dir, ConfigError, what="TrainingArguments.output_dir")
        engine = trainer.prepare_engine()
        loader, topology = trainer.train_dataloader, trainer.topology
        resume = resume_from_checkpoint
        if resume is None:
            resume = args.resume_from_checkpoint
        path = ckpt.resolve_resume(resume, trainer.checkpoint_dir, trainer.checkpoint_prefix)
        epoch_done, restore_rng, skips = False, None, False
        if path is not None and is_trainer_checkpoint(path):  # transformers wrote it
            state, restore_rng, skips = resume_from_transformers(
                engine,
                loader,
                path,
                steps_per_epoch=trainer.steps_per_epoch,
                gas=args.gradient_accumulation_steps,
                per_device=args.per_device_train_batch_size,
                topology=topology,
                say=trainer.say,
            )
            trainer.set_state(state)
            trainer.say(f"resuming from {path} (transformers, step {state.global_step})")
        elif path is not None:
            _, client = engine.load_checkpoint(str(path.parent), tag=path.name)
            trainer.set_state(TrainerState.from_dict(client.get("trainer_state", {})))
            epoch_done = bool(client.get("epoch_done"))
            trainer.say(f"resuming from {path} (step {trainer.state.global_step})")
        st = trainer.state
        st.max_steps, st.num_train_epochs = trainer.max_steps, trainer.num_epochs
        st.compute_steps(args, trainer.max_steps)  # transformers': an unset one keeps 500
        st.train_batch_size = args.per_device_train_batch_size
        st.is_world_process_zero = topology.rank == 0
        start_step = self.start_step = st.global_step
        trainer.say(
            training_header(
                num_examples=len(trainer.train_dataset),
                num_epochs=trainer.num_epochs,
                per_device=args.per_device_train_batch_size,
                total_batch=engine.config.train_batch_size,
                accumulation=args.gradient_accumulation_steps,
                max_steps=trainer.max_steps,
                num_params=trainer.num_parameters,
                processes=topology.world_size,
                zero_stage=engine.zero_stage,
                precision=engine.config.precision,
                tensor_parallel=topology.tp_size,
                pipeline_parallel=topology.pp_size,
            )
        )
        if engine.preemption is not None:
            engine.preemption.auto = False  # this loop saves its own state with the step
        trainer.set_control(TrainerControl())
        if path is not None and args.restore_callback_states_from_checkpoint:
            self._restore_callback_states()
        if path is None:  # transformers' new TrainerState holds them from the start
            st.stateful_callbacks = exported_states(
                [*trainer.callback_handler.callbacks, trainer.control]
            )
        # every module, once: training_step only checks the top flag, and a peft wrapper
        # says training while the from_pretrained model inside it is in eval mode
        trainer.model.train()
        trainer.fire_event("on_train_begin")
        t0 = time.perf_counter()
        run_loss = torch.zeros((), device=engine.device)  # this run's summed step shares
        log_loss = torch.zeros((), device=engine.device)
        log_steps = 0
        sampler = loader.sampler
        start_epoch = int(sampler.epoch) if path is not None else 0
        if path is not None and epoch_done and sampler.consumed >= len(trainer.train_dataset):
            start_epoch += 1
        n_rows = len(trainer.train_dataset)
        dp = topology.dp_size  # each rank's share is x dp: the sum over ranks / dp
        for epoch in range(start_epoch, trainer.num_epochs):
            if st.global_step >= trainer.max_steps or trainer.control.should_training_stop:
                break
            loader.set_epoch(epoch)
            if restore_rng is not None and not skips:  # transformers' points (transformers_resume)
                restore_rng()
            batches = iter(loader)
            trainer.fire_event("on_epoch_begin")
            while st.global_step < trainer.max_steps:
                window = list(itertools.islice(batches, args.gradient_accumulation_steps))
                if not window:
                    break
                if restore_rng is not None:
                    restore_rng()  # once: after the first window of a skipping resume
                trainer.fire_event("on_step_begin")
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
                trainer.fire_event("on_step_end")
                if trainer.control.should_log and log_steps:
                    comm.all_reduce(log_loss, topology.dp_group, label="control")
                    self._log_train(float(log_loss) / dp / log_steps)
                    log_loss.zero_()
                    log_steps = 0
                self._evaluate_and_save(ignore_keys_for_eval, epoch_done=False)
                self._preemption_point()
                if trainer.control.should_training_stop or trainer.control.should_epoch_stop:
                    break
            control = trainer.control
            control.should_epoch_stop = False
            # transformers fires on_epoch_end (and its log / evaluate / save) also when
            # training stops inside the epoch; the epoch then is not done
            stopped = st.global_step >= trainer.max_steps or control.should_training_stop
            epoch_done = not (stopped and sampler.consumed < n_rows)
            if epoch_done:
                st.epoch = float(epoch + 1)
            trainer.fire_event("on_epoch_end")
            if trainer.control.should_log and log_steps:
                comm.all_reduce(log_loss, topology.dp_group, label="control")
                self._log_train(float(log_loss) / dp / log_steps)
                log_loss.zero_()
                log_steps = 0
            self._evaluate_and_save(ignore_keys_for_eval, epoch_done=epoch_done)
            if not epoch_done:
                break
        return self._finish_training(run_loss, start_step, t0)

    def _run_window(self, window: list[Any]) -> tuple[torch.Tensor, float | None]:
        """One optimizer step over the micro-batches of ``window``: ``trainer.
        training_step`` per micro-batch and ``engine.step``, with transformers' events
        (``on_substep_end`` after each micro-batch but the last, then
        ``on_pre_optimizer_step`` / ``on_optimizer_step`` around the step), or the whole
        window through the pipeline schedule. Returns (this rank's step loss x dp, its
        mean loss per label item)."""
        trainer = self.trainer
        engine, args = trainer.engine, trainer.args
        counts, local_items, total_items = window_items(
            window, trainer.label_names, trainer.shifts_labels, trainer.topology,
            engine.device, across=args.average_tokens_across_devices,
        )  # fmt: skip
        if engine.pipeline is not None:  # the window runs in the pipeline's schedule
            batches = [trainer.prepare_inputs(b) for b in window]
            if not trainer.model.training:
                trainer.model.train()
            share = trainer.pp_steps.train_window(batches, counts, total_items)
            for _ in range(len(window) - 1):  # the micro-batches interleave in the schedule
                trainer.fire_event("on_substep_end")
            trainer.fire_event("on_pre_optimizer_step")
            self.applied_lr = engine.get_lr()[0]
            engine.step()
            trainer.fire_event("on_optimizer_step")
            return share, self._local_mean(share, local_items, total_items)
        engine.shorten_window(len(window))  # the epoch's short last window steps too
        num_items = torch.tensor(total_items, device=engine.device)
        share = torch.zeros((), device=engine.device)  # read once: no sync per micro-batch
        last = len(window) - 1
        for i, batch in enumerate(window):
            part = trainer.training_step(trainer.model, batch, num_items)
            if not counts[i] and args.average_tokens_across_devices:
                part = torch.zeros_like(part)  # weight 0; a mean over no items is NaN
            share += part
            if i == last:
                trainer.fire_event("on_pre_optimizer_step")
                self.applied_lr = engine.get_lr()[0]  # what this step uses (logged as such)
            engine.step()
            if i < last:
                trainer.fire_event("on_substep_end")
        trainer.fire_event("on_optimizer_step")
        return share, self._local_mean(share, local_items, total_items)

    def _local_mean(self, share: torch.Tensor, local: float, total: float) -> float | None:
        """This rank's mean loss per label item (what the engine's step log shows)."""
        if not local or self.trainer.loss_is_share():
            return None
        return float(share) * total / self.trainer.topology.dp_size / local

    def _restore_callback_states(self) -> None:
        """transformers' ``_load_callback_state``: each saved ``ExportableState`` whose
        class the Trainer has again is rebuilt from its saved state (instances of one
        class in order); saved ones the Trainer lacks are named in a warning."""
        import warnings

        trainer = self.trainer
        handler = trainer.callback_handler
        current = [*handler.callbacks, trainer.control]
        missing = []
        for name, data in trainer.state.stateful_callbacks.items():
            saved = data if isinstance(data, list) else [data]
            same = [c for c in current if type(c).__name__ == name]
            if not same:
                missing.append(name)
                continue
            for old, state in zip(same, saved, strict=False):
                new = type(old).from_state(state)
                if isinstance(old, TrainerControl):
                    trainer.set_control(new)
                else:
                    i = handler.callbacks.index(old)
                    handler.callbacks[i] = new
        if missing:
            warnings.warn(
                "the checkpoint holds the state of callbacks this Trainer does not have; "
                f"ignored: {', '.join(missing)}",
                stacklevel=4,
            )

    def _log_train(self, loss: float) -> None:
        trainer = self.trainer
        grad_norm = trainer.engine.get_global_grad_norm()
        trainer.log(
            {
                "loss": loss,
                "grad_norm": grad_norm if grad_norm is not None else float("nan"),
                "learning_rate": self.applied_lr,
            }
        )

    def _evaluate_and_save(self, ignore_keys: list[str] | None, epoch_done: bool) -> None:
        trainer = self.trainer
        args = trainer.args
        metrics = None
        if trainer.control.should_evaluate:
            metrics = trainer.evaluate(ignore_keys=ignore_keys)
            self._update_best(metrics)
            control = trainer.control  # the one the evaluation's callbacks returned
            control.should_evaluate = False
        if trainer.control.should_save or (
            args.save_strategy == "best" and metrics is not None and self.improved
        ):
            if args.save_strategy != "best" or (metrics is not None and self.improved):
                self._save_checkpoint(epoch_done)
            control = trainer.control  # the one on_save returned
            control.should_save = False
        control = trainer.control
        control.should_log = False

    def _update_best(self, metrics: dict[str, float]) -> None:
        self.improved = False
        args, st = self.trainer.args, self.trainer.state
        key = args.metric_key
        if key is None:
            return
        if key not in metrics:
            raise ConfigError(
                f"TrainingArguments.metric_for_best_model={args.metric_for_best_model!r}: "
                f"the evaluation returned no {key!r}; available: {sorted(metrics)}. Use one of "
                "those names (without the eval_ prefix) or return it from compute_metrics"
            )
        value = float(metrics[key])
        if ckpt.is_better(value, st.best_metric, bool(args.greater_is_better)):
            st.best_metric = value
            st.best_global_step = st.global_step
            self.improved = True

    def _save_checkpoint(self, epoch_done: bool) -> None:
        """``output_dir/checkpoint-<step>`` (see ``meshtrain.trainer.checkpoints``)."""
        from meshtrain.accelerate.peft_io import is_peft_model, prompt_embeddings

        trainer = self.trainer
        st, args, engine, saver = trainer.state, trainer.args, trainer.engine, trainer.saver
        root, prefix = trainer.checkpoint_dir, trainer.checkpoint_prefix
        tag = f"{prefix}{st.global_step}"
        if st.best_global_step == st.global_step:
            st.best_model_checkpoint = os.path.join(root, tag)
        st.stateful_callbacks = exported_states(
            [*trainer.callback_handler.callbacks, trainer.control]
        )
        client = {"trainer_state": st.to_dict(), "epoch_done": epoch_done}
        # a synchronous save runs ``beside`` on every rank at once: the ranks write the
        # weights from their shards; an asynchronous one runs it in the background, where
        # no collective may run, so the whole weights are gathered now (as a peft adapter's)
        from_ranks = not engine.config.checkpoint.async_save and not is_peft_model(trainer.model)
        state_dict = None if from_ranks else engine.module_state_dict()  # every rank: whole
        prompts = prompt_embeddings(engine, trainer.model)  # ZeRO-3 prompt tuning: all ranks
        snapshot = TrainerState.from_dict(st.to_dict())  # an async write runs on after this
        rank = trainer.topology.rank

        def beside(path) -> None:  # after the commit (in the background under async_save)
            if from_ranks:
                engine.save_weights(path)  # collective: each file from the ranks holding it
            if rank == 0:
                # transformers' files beside the shards: the model (``from_pretrained`` loads
                # the folder), the tokenizer / processor, the arguments as JSON, the state
                if from_ranks:
                    saver.export_files(path)
                else:
                    saver.export(path, state_dict, prompts)
                saver.write_args(path)
                snapshot.save_to_json(path / "trainer_state.json")
                best = ckpt.step_of(snapshot.best_model_checkpoint, prefix)
                steps = ckpt.checkpoint_steps(root, prefix)
                ckpt.delete(root, ckpt.to_delete(steps, args.save_total_limit, best), prefix)

        self.last_checkpoint = (
            st.global_step,
            engine.save_checkpoint(root, tag=tag, client_state=client, on_commit=beside),
        )
        barrier()
        trainer.fire_event("on_save")

    def _preemption_point(self) -> None:
        """Every rank together: a SIGTERM/SIGUSR1 any rank caught (``checkpoint.
        save_on_preemption``) saves this step (unless just saved) and exits with code 75."""
        trainer = self.trainer
        guard = trainer.engine.preemption
        if guard is None or not guard.requested(trainer.topology.group("world")):
            return
        from meshtrain.engine.preemption import preempt

        step, path = self.last_checkpoint or (None, None)
        if step != trainer.state.global_step:
            self._save_checkpoint(epoch_done=False)
            step, path = self.last_checkpoint
        trainer.engine.wait_for_checkpoint()
        raise preempt(step, path, guard.late_by)

    def _finish_training(self, run_loss: torch.Tensor, start_step: int, t0: float) -> TrainOutput:
        from meshtrain.distributed import comm

        trainer = self.trainer
        st, args, engine, topology = trainer.state, trainer.args, trainer.engine, trainer.topology
        root, prefix = trainer.checkpoint_dir, trainer.checkpoint_prefix
        engine.wait_for_checkpoint()  # an asynchronous save is committed on return
        comm.all_reduce(run_loss, topology.dp_group, label="control")
        steps = max(1, st.global_step - start_step)
        train_loss = float(run_loss) / topology.dp_size / steps
        if args.load_best_model_at_end and st.best_model_checkpoint:
            best = ckpt.resolve_resume(st.best_model_checkpoint, root)
            if best is not None and best.is_dir():
                trainer.say(f"Loading best model from {best} (score: {st.best_metric}).")
                engine.load_checkpoint(str(best.parent), tag=best.name, load_module_only=True)
        if args.save_total_limit == 1 and st.best_model_checkpoint and topology.rank == 0:
            # transformers: with a limit of 1 only the best checkpoint outlives training
            best = ckpt.step_of(st.best_model_checkpoint, prefix)
            saved = ckpt.checkpoint_steps(root, prefix)
            others = [s for s in saved if s != best] if best in saved else []
            ckpt.delete(root, others, prefix)
        barrier()
        trainer.hand_back_model()
        runtime = time.perf_counter() - t0
        samples = steps * engine.config.train_batch_size
        metrics = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(samples / runtime, 3),
            "train_steps_per_second": round(steps / runtime, 3),
            # the engine's model FLOPs (MFU's count); left out where it knows none
            **({"total_flos": st.total_flos} if "flops" in engine.log.last else {}),
            "train_loss": train_loss,
        }
        trainer.log(metrics)  # adds the epoch to the metrics returned, as transformers' does
        trainer.fire_event("on_train_end")
        table = end_table(st.log_history)
        if table:
            trainer.say(table)
        return TrainOutput(st.global_step, train_loss, metrics)


__all__ = ["TrainingLoop"]
