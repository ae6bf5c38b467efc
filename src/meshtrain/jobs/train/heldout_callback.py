"""When ``meshtrain train`` evaluates its held-out split: a Trainer callback.

Every ``train.eval_interval`` optimizer steps and at the last step (``max_steps``), on
every rank, after the step's own log row and before its checkpoint (so an evaluation at a
save step describes exactly the weights saved). The numbers go through the Trainer's
public ``log``: its run log writes them into ``metrics.jsonl`` as an ``eval_*`` row and
into TensorBoard as ``eval/loss``, ``eval/perplexity``, ... and prints transformers'
``{'eval_loss': ...}`` line. The evaluation's time and bytes are kept out of the next
step's numbers (``engine.between_steps``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshtrain.jobs.train.heldout import HeldOut
from meshtrain.trainer.callbacks import TrainerCallback


class HeldOutCallback(TrainerCallback):
    """Evaluate ``heldout`` every ``interval`` steps (0: only at the end) and at the end;
    ``log`` is the Trainer's ``log``. ``evaluations`` keeps this run's (step, result)."""

    def __init__(self, heldout: HeldOut, interval: int, log: Callable[[dict], None]) -> None:
        self.heldout = heldout
        self.interval = int(interval)
        self.log = log
        self.evaluations: list[tuple[int, dict[str, Any]]] = []

    def on_step_end(self, args, state, control, engine=None, **kwargs):
        step = state.global_step
        due = step >= state.max_steps or (self.interval and step % self.interval == 0)
        if not due or engine is None:
            return None
        with engine.between_steps():
            result = self.heldout.evaluate(engine.module, engine.topology.dp_group, engine.device)
        self.evaluations.append((step, result))
        self.log({f"eval_{key}": value for key, value in result.items()})
        return None


__all__ = ["HeldOutCallback"]
