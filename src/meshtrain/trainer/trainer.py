"""``Trainer``: transformers' training loop API on meshtrain's engine.

``from meshtrain import Trainer, TrainingArguments`` runs a transformers Trainer script
unchanged on one process or many (``meshtrain launch``, torchrun, ``python script.py``,
``notebook_launcher``), under data parallelism or ZeRO 1-3 (``deepspeed=`` / ``mesh=``),
tensor or pipeline parallelism (``trainer.pipeline_step``).

One optimizer step: fetch the ``gradient_accumulation_steps`` micro-batches of the
window, count their label items, all-reduce the count over the data-parallel ranks, then
forward / ``engine.backward(loss, weight=n / N)`` / ``engine.step`` each, the weight the
micro-batch's share of the step's label items, so the step equals one big batch
(``meshtrain.trainer.loss``). The data loader is meshtrain's
resumable distributed loader, so a checkpoint records the exact data position and
``resume_from_checkpoint`` continues with the next unseen batch. See docs/trainer.md.

The class keeps transformers' public methods; the jobs that take more than a method are
collaborators it builds and holds: ``self.loop`` (``training_loop.TrainingLoop``:
``train()``, its windows, logging, evaluation, checkpoints, the end), ``self.evaluator``
(``prediction.Evaluator``: ``evaluate``, ``predict``, the eval loader) and ``self.saver``
(``saving.ModelSaver``: ``save_model``, ``save_state``, the export). Each holds this
Trainer and calls back through it (``trainer.training_step``, ``trainer.compute_loss``
through it, ``trainer.prediction_step``, ``trainer.evaluate``, ``trainer.log``), so what
a subclass overrides runs exactly where transformers would run it; the per-batch hooks
themselves (``compute_loss``, ``training_step``, ``prediction_step``) are this class's.
The collaborators read the Trainer's public members and change it only through its
methods (``fire_event``, ``set_state``, ``set_control``, ``hand_back_model``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from meshtrain.errors import ConfigError, TrainingError
from meshtrain.models.kv_cache import CACHE_NAMES
from meshtrain.models.packed_batches import check_packed_batch
from meshtrain.trainer import checkpoints as ckpt
from meshtrain.trainer import evaluation as ev
from meshtrain.trainer import results, setup
from meshtrain.trainer.arguments import TrainingArguments
from meshtrain.trainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    RunLogCallback,
    TrainerCallback,
)
from meshtrain.trainer.inputs import move_to_device
from meshtrain.trainer.loss import (
    forward_names,
    label_items,
    loss_shifts_labels,
    takes_argument,
)
from meshtrain.trainer.pipeline_step import PipelineSteps, user_loss
from meshtrain.trainer.prediction import Evaluator
from meshtrain.trainer.saving import ModelSaver, is_local_process_zero, is_world_process_zero
from meshtrain.trainer.state import PredictionOutput, TrainerControl, TrainerState, TrainOutput
from meshtrain.trainer.training_loop import TrainingLoop


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (transformers' ``set_seed``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Train, evaluate and predict with transformers' Trainer API on meshtrain's engine.

    Args follow transformers: ``model``, ``args`` (:class:`TrainingArguments`),
    ``data_collator``, ``train_dataset``, ``eval_dataset`` (a dataset or a dict of them),
    ``processing_class`` / ``tokenizer``, ``compute_metrics(EvalPrediction) -> dict``,
    ``callbacks``, ``optimizers=(optimizer, scheduler)``, ``compute_loss_func(outputs,
    labels, num_items_in_batch)``, ``preprocess_logits_for_metrics(logits, labels)``.

    Besides transformers' attributes, set-up fills in what the collaborators read
    (module docstring): ``pp_steps`` (the ``PipelineSteps`` under pipeline
    parallelism, else None), ``gather_vocab`` (under tensor parallelism with a
    vocab-parallel head: makes sharded logits whole; None otherwise, and once ``train()``
    handed the model back), ``model_handed_back`` (after ``train()``: the user's model
    holds the whole trained weights on every rank), ``evaluate_whole_model`` (pp x tp
    after ``train()``: evaluation runs the restored model whole, not the pipeline) and
    ``shifts_labels`` (a causal LM: its first label per row is never a target).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        preprocess_logits_for_metrics: Callable | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.args = args if args is not None else TrainingArguments()
        set_seed(self.args.seed)
        if model is None:
            if model_init is None:
                raise ConfigError("Trainer: pass model= (or model_init=)")
            model = model_init()
        self.model = model
        self.processing_class = processing_class if processing_class is not None else tokenizer
        self.tokenizer = self.processing_class
        self.data_collator = setup.choose_collator(
            data_collator, self.processing_class, self.args.padding_free
        )
        setup.apply_use_cache(model, self.args.use_cache)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.loss_is_scaled_for_ga: bool | None = None
        names = forward_names(model)
        # transformers' rule, less the Decoder's shift_labels (context parallelism's)
        found = [n for n in (names or ()) if "label" in n and n != "shift_labels"]
        self.label_names = self.args.label_names or found or ["labels"]
        self._forward_names = names
        self.shifts_labels = loss_shifts_labels(model)
        self.engine = None
        self.gather_vocab = None  # set by _setup under tensor parallelism
        self.pp_steps: PipelineSteps | None = None  # set by _setup under pp
        self.evaluate_whole_model = False  # pp x tp after train(): the restored model whole
        self.model_handed_back = False  # after train(): the user's model holds the weights
        self._new_signature: tuple[Any, bool] = (None, False)  # compute_loss's signature
        # where checkpoints go and how they are named (``meshtrain train`` uses its own)
        self.checkpoint_dir = self.args.output_dir
        self.checkpoint_prefix = ckpt.PREFIX
        self.state = TrainerState()
        self.control = TrainerControl()
        self.callback_handler = CallbackHandler(
            [DefaultFlowCallback(), RunLogCallback(), *(callbacks or [])]
        )
        # the jobs of more than one method, each holding this Trainer (module docstring)
        self.loop = TrainingLoop(self)
        self.evaluator = Evaluator(self)
        self.saver = ModelSaver(self)
        self.fire_event("on_init_end")

    # -- callbacks ------------------------------------------------------------------------
    def add_callback(self, callback: TrainerCallback | type) -> None:
        self.callback_handler.add(callback)

    def pop_callback(self, callback: TrainerCallback | type) -> Any:
        return self.callback_handler.pop(callback)

    def set_checkpoint_location(self, directory: str, prefix: str = ckpt.PREFIX) -> None:
        """Where checkpoints go and how their folders are named (default:
        ``output_dir/checkpoint-<step>``; ``meshtrain train`` uses ``global_step<N>``)."""
        self.checkpoint_dir, self.checkpoint_prefix = directory, prefix

    def remove_callback(self, callback: TrainerCallback | type) -> None:
        self.callback_handler.pop(callback)

    def fire_event(self, name: str, **kwargs: Any) -> TrainerControl:
        """Call every callback's ``name`` event (``on_step_end``, ``on_evaluate``, ...) with
        this Trainer's args, state and control, and keep the control they return as
        ``self.control``, which this returns."""
        self.control = self.callback_handler.call(
            name,
            self.args,
            self.state,
            self.control,
            model=self.model,
            engine=self.engine,
            optimizer=None if self.engine is None else self.engine.optimizer,
            lr_scheduler=None if self.engine is None else self.engine.lr_scheduler,
            processing_class=self.processing_class,
            **kwargs,
        )
        return self.control

    def set_state(self, state: TrainerState) -> None:
        """Take ``state`` as this run's ``TrainerState`` (a resumed checkpoint's)."""
        self.state = state

    def set_control(self, control: TrainerControl) -> None:
        """Take ``control`` as the callbacks' ``TrainerControl`` (fresh at ``train()``, or
        restored from a checkpoint)."""
        self.control = control

    @property
    def start_step(self) -> int:
        """The global step the last ``train()`` began at (0, or the resumed step)."""
        return self.loop.start_step

    @property
    def run_log_rows(self) -> list:
        """The rows the run log kept (``RunLogCallback``; ``meshtrain train`` reads them)."""
        handler = self.callback_handler
        logger = next((c for c in handler.callbacks if isinstance(c, RunLogCallback)), None)
        return [] if logger is None else logger.rows

    # -- set-up ---------------------------------------------------------------------------
    def prepare_dataset(self, dataset: Any) -> Any:
        """``dataset`` with the columns the model's forward takes (and the labels)."""
        columns = setup.signature_columns(self.model)
        return setup.prepare_dataset(dataset, self.args, columns, self.label_names)

    def prepare_engine(self):
        """Process group, mesh, engine and training loader (once); returns the engine."""
        self._setup()
        return self.engine

    def _setup(self) -> None:
        """The one call into set-up (``trainer.setup.build_engine``); everything it builds
        is assigned here, by the Trainer itself."""
        if self.engine is not None:
            return
        built = setup.build_engine(
            model=self.model,
            args=self.args,
            train_dataset=self.train_dataset,
            data_collator=self.data_collator,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            label_names=self.label_names,
        )
        self.engine, self.topology = built.engine, built.topology
        self.train_dataset, self.train_dataloader = built.train_dataset, built.train_dataloader
        self.steps_per_epoch, self.max_steps = built.steps_per_epoch, built.max_steps
        self.num_epochs, self.num_parameters = built.num_epochs, built.num_parameters
        self.state.is_world_process_zero = self.topology.rank == 0
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.gather_vocab = ev.vocab_gatherer(self.engine, self.model)
        if self.engine.pipeline is not None:  # the user's loss, if any, on the last stage
            mine = user_loss(type(self), Trainer, self.compute_loss_func, self.label_names)
            self.pp_steps = PipelineSteps(
                self.engine, self.model, self.label_names,
                compute_loss=self._call_compute_loss if mine else None,
                prediction_step=self.prediction_step if mine else None,
                loss_is_share=self.loss_is_share, forward_names=self._forward_names,
                gather_vocab=self.gather_vocab,
            )  # fmt: skip
        self.optimizer = self.engine.optimizer
        self.lr_scheduler = self.engine.lr_scheduler

    def create_optimizer(self, model: nn.Module | None = None):
        """The optimizer (transformers' contract: build it once from ``args`` unless one
        was given, keep it in ``self.optimizer``, return it). Before ``train()`` it is a
        torch optimizer of ``args.optim`` over transformers' weight-decay groups, which
        the engine then wraps; after set-up it is the engine's optimizer."""
        if self.optimizer is None:
            spec = self.args.optimizer_section()  # the engine config's optimizer section
            cls = getattr(torch.optim, spec["type"])
            groups = setup.param_groups(model if model is not None else self.model)
            self.optimizer = cls(groups, **spec["params"])
        return self.optimizer

    def get_train_dataloader(self):
        """The resumable training loader (deals rows by data-parallel rank)."""
        self._setup()
        return self.train_dataloader

    # -- one step -------------------------------------------------------------------------
    def prepare_inputs(self, inputs: Any) -> Any:
        """Move a batch to the engine's device (floats to the training dtype); a packed
        batch made safe for the model or refused (``models.packed_batches``)."""
        inputs = move_to_device(inputs, self.engine.device, self.engine.dtype)
        return check_packed_batch(self.model, inputs)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ):
        """The model's loss on ``inputs`` (a mean over the batch's label items).

        A model whose ``forward`` does not take the labels gets the inputs without them;
        its loss then comes from ``compute_loss_func``, or from an output named ``loss``.
        """
        inputs = dict(inputs)
        labels = None
        names = self._forward_names
        if names is not None or self.compute_loss_func is not None:
            wanted = [n for n in self.label_names if n in inputs]
            if self.compute_loss_func is not None or any(n not in names for n in wanted):
                labels = inputs.pop(wanted[0]) if wanted else None
                for n in wanted[1:]:
                    inputs.pop(n)
        outputs = model(**inputs)
        if self.compute_loss_func is not None:
            if self.gather_vocab is not None:  # tp: the user's loss sees the whole vocabulary
                outputs = self.gather_vocab(outputs)
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif isinstance(outputs, Mapping) and outputs.get("loss") is not None:
            loss = outputs["loss"]
        elif isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
            loss = outputs  # a model that returns its loss (meshtrain's Decoder, ...)
        elif isinstance(outputs, tuple | list) and any(n in inputs for n in self.label_names):
            loss = outputs[0]  # return_dict=False: the loss comes first
        else:
            raise TrainingError(
                f"{type(model).__name__} returned no loss for a batch with keys "
                f"{sorted(inputs)}: give it labels it accepts ({self.label_names}), pass "
                "compute_loss_func=, or override Trainer.compute_loss"
            )
        return (loss, outputs) if return_outputs else loss

    def _call_compute_loss(
        self, model: nn.Module, inputs: Any, return_outputs: bool, num_items: Any = None
    ):
        """Call ``compute_loss`` with the new signature, or the old one (no
        ``num_items_in_batch``) that seed scripts override it with."""
        fn = self.compute_loss
        key = getattr(fn, "__func__", fn)
        if self._new_signature[0] is not key:  # inspect once per override, not per step
            self._new_signature = (key, takes_argument(fn, "num_items_in_batch"))
        if self._new_signature[1]:
            return fn(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items)
        return fn(model, inputs, return_outputs=return_outputs)

    def loss_is_share(self) -> bool:
        """Whether ``compute_loss`` returns a share of the window (``S / N``, already
        divided by the window's label items) rather than a mean over its own items:
        ``loss_is_scaled_for_ga`` when set, else whether ``compute_loss_func`` is given."""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return self.compute_loss_func is not None

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch (transformers' signature and contract);
        the optimizer step is the loop's. Returns the detached loss this micro-batch adds
        to the step's logged loss: ``loss / gradient_accumulation_steps`` when the
        micro-batches carry equal label items (exactly transformers' value then).

        With ``num_items_in_batch`` (the label items of the whole optimizer step over every
        data-parallel rank, what the loop passes) the loss is weighted by this
        micro-batch's items so the step equals one big batch (``meshtrain.trainer.loss``);
        without it each micro-batch counts ``1 / gradient_accumulation_steps``, as in
        transformers."""
        engine = self.engine
        if engine is None:
            raise TrainingError(
                "Trainer.training_step needs the engine: call trainer.train() or "
                "trainer.prepare_engine() first"
            )
        if not model.training:  # after an evaluation (train() walks every module)
            model.train()
        inputs = self.prepare_inputs(inputs)
        if isinstance(inputs, Mapping):  # samples/s and tokens/s of the engine's step log
            engine.log.count_batch((), inputs)
        loss = self._call_compute_loss(model, inputs, False, num_items_in_batch)
        if isinstance(loss, tuple | list):
            loss = loss[0]
        gas, dp = self.args.gradient_accumulation_steps, self.topology.dp_size
        total = None if num_items_in_batch is None else float(num_items_in_batch)
        # the loss's weight in the step's gradient (``Engine.backward``), and its share of
        # the step's logged loss x dp (the loop sums the ranks' shares and divides by dp)
        if self.loss_is_share():  # already S / N: counted whole
            weight, logged = 1.0, float(dp)
        elif total:  # this micro-batch's share n / N of the step's label items
            n = label_items(inputs, self.label_names, self.shifts_labels)
            weight = n / total
            logged = weight * dp
        elif total is None:  # transformers without item counts: the engine's mean
            weight, logged = None, 1.0 / gas
        else:  # a window without label items contributes nothing
            weight, logged = 0.0, 0.0
        engine.backward(loss, weight=weight)
        return loss.detach().float() * logged

    # -- the loops: transformers' methods, each the job of a collaborator -----------------
    def train(
        self,
        resume_from_checkpoint: bool | str | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Train to ``max_steps`` / ``num_train_epochs`` (``TrainingLoop.train``),
        resuming from ``resume_from_checkpoint`` (a path, or True: the latest in
        ``output_dir``); ``trial`` (hyperparameter search) is not supported."""
        return self.loop.train(resume_from_checkpoint, ignore_keys_for_eval)

    def hand_back_model(self) -> None:
        """Give the user's model object the whole trained weights on every rank (the end of
        ``train()``): under ZeRO-3 its parameters are shards between steps (gathered, hooks
        removed); under tensor parallelism its layers are tensor-parallel ones (the
        original modules go back, holding the gathered, unpadded weights;
        ``parallel.tensor.restore``); under pipeline parallelism the blocks the split freed
        get the trained weights back (``PipelineSteps.restore_user_model``), first, so that
        under pp x tp each rank has its tp rank's shards of every block before they are
        gathered. Evaluation and prediction then run the whole model on every rank (under
        pp alone they keep running through the pipeline)."""
        self.model_handed_back = True  # the engine's shards no longer map the model's tensors
        self.engine.zero.release_module(self.engine.module)
        if self.pp_steps is not None:  # other stages' blocks: weights back
            # under tp too: each rank receives its own tp rank's shards (the pp group
            # holds one tp rank), so the un-sharding below then has every block's shards
            self.pp_steps.restore_user_model()
        if self.topology.tp_size > 1:
            from meshtrain.parallel.tensor.restore import remove_tensor_parallel

            # on the user's model: tensor parallelism was applied to it whole, before a split
            remove_tensor_parallel(self.model, self.topology.tp_group)
            self.gather_vocab = None  # the logits are whole now
            self.evaluate_whole_model = self.pp_steps is not None

    def get_eval_dataloader(self, eval_dataset: Any = None):
        """The batches this rank evaluates (its rows of the dataset; ``evaluate``'s)."""
        return self.evaluator.get_eval_dataloader(eval_dataset)

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Loss and ``compute_metrics`` on ``eval_dataset``; keys start with ``eval_``."""
        return self.evaluator.evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> PredictionOutput:
        """Predictions for exactly the rows of ``test_dataset``, in order, on every rank."""
        return self.evaluator.predict(test_dataset, ignore_keys, metric_key_prefix)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """(loss, logits, labels) of one batch; the loss goes through ``compute_loss``
        whenever the batch has labels, so custom losses and label-less forwards work."""
        has_labels = isinstance(inputs, Mapping) and all(
            inputs.get(n) is not None for n in self.label_names
        )
        with torch.no_grad():
            if has_labels:
                loss, outputs = self._call_compute_loss(model, inputs, True)
                loss = loss.detach().float().mean()
            else:
                loss, outputs = None, model(**inputs)
        if prediction_loss_only:
            return loss, None, None
        if self.gather_vocab is not None:  # tensor parallelism: whole-vocabulary logits
            outputs = self.gather_vocab(outputs)
        if ignore_keys is None:  # as transformers: e.g. a decoder's key/value cache
            config = getattr(self.model, "config", None)
            ignore_keys = getattr(config, "keys_to_ignore_at_inference", list(CACHE_NAMES))
        logits = ev.logits_of(outputs, ignore_keys)
        labels = None
        if has_labels:
            found = tuple(inputs[n] for n in self.label_names)
            labels = found[0] if len(found) == 1 else found
        return loss, logits, labels

    # -- saving (``saving.ModelSaver``) ---------------------------------------------------
    def is_world_process_zero(self) -> bool:
        """Whether this is global rank 0 (the process that writes shared files)."""
        return is_world_process_zero()

    def is_local_process_zero(self) -> bool:
        """Whether this is rank 0 of its node."""
        return is_local_process_zero()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model's whole weights into ``output_dir`` (default ``args.output_dir``),
        with ``save_pretrained``'s files (``saving``'s module docstring). Every rank must
        call it."""
        self.saver.save_model(output_dir)

    def save_state(self) -> None:
        """``trainer_state.json`` (log history, best checkpoint, step) in ``output_dir``."""
        self.saver.save_state()

    # -- results: transformers' example-script calls (``trainer.results``) ----------------
    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` as transformers' formatted table (rank 0)."""
        results.log_metrics(split, metrics, self.is_world_process_zero())

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """``<split>_results.json`` (and ``all_results.json``) in ``output_dir`` (rank 0)."""
        results.save_metrics(
            self.args.output_dir, split, metrics, self.is_world_process_zero(), combined
        )

    def create_model_card(self, **card: Any) -> None:
        """``README.md`` in ``output_dir``, transformers' model card (rank 0)."""
        results.create_model_card(self, **card)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        """Refused by name: meshtrain does not upload (``results.refuse_push``)."""
        results.refuse_push("Trainer.push_to_hub")

    # -- logging --------------------------------------------------------------------------
    def say(self, text: str) -> None:
        """Print ``text`` once: on global rank 0 (on every process before set-up)."""
        if getattr(self, "topology", None) is None or self.topology.rank == 0:
            print(text, flush=True)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add ``logs`` (with epoch and step) to ``state.log_history``; calls ``on_log``.
        The epoch goes into ``logs`` itself, as in transformers: the metrics dict that
        ``train()`` / ``evaluate()`` return then carries it (``train_results.json``)."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.fire_event("on_log", logs=logs)


__all__ = ["Trainer", "set_seed"]
