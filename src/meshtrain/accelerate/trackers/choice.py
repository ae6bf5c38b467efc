"""Which trackers an ``Accelerator(log_with=...)`` runs, as accelerate chooses them, and the
calls that drive them (``init_trackers``, ``log``, ``get_tracker``, ``end_training``).

``log_with``: a name, a tracker object (anything with accelerate's ``GeneralTracker``
members: ``name``, ``log``, ``store_init_configuration``, ``finish``), or a list of them.
``"all"`` means every tracker accelerate knows whose package is installed; meshtrain writes
``"tensorboard"`` itself and adds ``"jsonl"`` (asked for by name only, so ``"all"`` writes
what accelerate writes). A tracker accelerate knows but meshtrain does not write (wandb,
mlflow, ...), or one whose package is not installed, is named in a warning and skipped:
accelerate skips an uninstalled one silently, and the run goes on in both. A directory is
needed (``project_dir=``) for the file trackers, as accelerate requires.

Trackers live on the main process only; ``log`` elsewhere does nothing.
"""

from __future__ import annotations

import importlib.util
import logging
import types
from typing import Any

from meshtrain.errors import ConfigError

log = logging.getLogger("meshtrain")

# accelerate 1.15's tracker names and the package each needs
ACCELERATE_TRACKERS = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "trackio": "trackio",
    "aim": "aim",
    "comet_ml": "comet_ml",
    "mlflow": "mlflow",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
}
WRITTEN = ("tensorboard", "jsonl")


def _installed(name: str) -> bool:
    return importlib.util.find_spec(ACCELERATE_TRACKERS.get(name, name)) is not None


def _custom(item: Any) -> bool:
    return not isinstance(item, str) and all(
        hasattr(item, a) for a in ("name", "log", "store_init_configuration", "finish")
    )


class Trackers:
    """The trackers of one Accelerator (module docstring)."""

    def __init__(self, log_with: Any, logging_dir: str | None, is_main: bool) -> None:
        items = [] if log_with is None else log_with
        items = list(items) if isinstance(items, list | tuple) else [items]
        self.logging_dir = logging_dir
        self.is_main = is_main
        self.names: list[str] = []
        self.custom = [i for i in items if _custom(i)]
        for item in items:
            if _custom(item):
                continue
            name = str(getattr(item, "value", item)).lower()
            if name == "all":
                wanted = [n for n in ACCELERATE_TRACKERS if _installed(n)]
            elif name in ACCELERATE_TRACKERS or name == "jsonl":
                wanted = [name]
            else:
                raise ConfigError(
                    f"Accelerator(log_with={item!r}): no such tracker; use one of 'all', "
                    f"{', '.join(repr(n) for n in (*ACCELERATE_TRACKERS, 'jsonl'))} or a "
                    "tracker object"
                )
            for n in wanted:
                if n not in self.names and self._usable(n, explicit=name != "all"):
                    self.names.append(n)
        if self.names and logging_dir is None:
            raise ConfigError(
                f"Accelerator(log_with=...): {', '.join(self.names)} write files and need a "
                "directory; pass project_dir="
            )
        self.trackers: list[Any] = []

    def _usable(self, name: str, explicit: bool) -> bool:
        if name not in WRITTEN:
            log.warning(
                "Accelerator(log_with): the %r tracker is not written by meshtrain; "
                "nothing is logged to it (use 'tensorboard' or 'jsonl')",
                name,
            )
            return False
        if name == "tensorboard" and not _installed(name):
            if explicit:  # accelerate skips it silently; say what is missing
                log.warning(
                    "Accelerator(log_with='tensorboard'): the tensorboard package is not "
                    "installed, so nothing is logged to it; pip install tensorboard"
                )
            return False
        return True

    def init(self, project_name: str, config: dict | None, init_kwargs: dict | None) -> None:
        """``init_trackers``: start each tracker and store ``config`` (main process)."""
        if not self.is_main:
            return
        from meshtrain.accelerate.trackers.jsonl import JSONLTracker
        from meshtrain.accelerate.trackers.tensorboard import TensorBoardTracker

        kinds = {"tensorboard": TensorBoardTracker, "jsonl": JSONLTracker}
        kwargs = init_kwargs or {}
        self.trackers = [*self.custom] + [
            kinds[n](project_name, self.logging_dir, **kwargs.get(n, {})) for n in self.names
        ]
        if config is not None:
            for t in self.trackers:
                t.store_init_configuration(config)

    def log(self, values: dict, step: int | None, log_kwargs: dict | None) -> None:
        if not self.is_main:
            return
        for t in self.trackers:
            t.log(values, step=step, **(log_kwargs or {}).get(t.name, {}))

    def get(self, name: str, unwrap: bool) -> Any:
        if not self.trackers:  # accelerate: a blank tracker where none was started
            nothing = lambda *a, **k: None  # noqa: E731
            return types.SimpleNamespace(
                name=name, tracker=None, log=nothing, store_init_configuration=nothing,
                finish=nothing,
            )  # fmt: skip
        for t in self.trackers:
            if t.name == name:
                return t.tracker if unwrap else t
        raise ConfigError(
            f"get_tracker({name!r}): no such tracker started; started: "
            f"{[t.name for t in self.trackers] or 'none'} (log_with= and init_trackers())"
        )

    def finish(self) -> None:
        for t in self.trackers:
            t.finish()
        self.trackers = []


__all__ = ["ACCELERATE_TRACKERS", "Trackers"]
