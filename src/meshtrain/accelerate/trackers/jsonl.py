"""meshtrain's JSONL tracker (``log_with="jsonl"``; accelerate has none): one JSON object
per ``accelerator.log`` call in ``<logging_dir>/<project_name>/metrics.jsonl`` (``step``
first when given, then the values as logged), and the run's config in ``config.json``
beside it. Readable with no TensorBoard, diffable, and appended to on resume."""

from __future__ import annotations

import json
import os
from typing import Any


class JSONLTracker:
    """One JSONL run on the main process (module docstring)."""

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **_: Any) -> None:
        self.run_name = run_name
        self.logging_dir = os.path.join(logging_dir, run_name)
        os.makedirs(self.logging_dir, exist_ok=True)
        self.path = os.path.join(self.logging_dir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by finish

    @property
    def tracker(self):
        return self._file

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        with open(os.path.join(self.logging_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(values, f, indent=2, sort_keys=True, default=str)

    def log(self, values: dict[str, Any], step: int | None = None, **_: Any) -> None:
        row = ({} if step is None else {"step": step}) | dict(values)
        self._file.write(json.dumps(row, default=float) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


__all__ = ["JSONLTracker"]
