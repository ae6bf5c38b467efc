"""The project's exception types.

Every error a user can cause (a bad config key, a bad data row, a checkpoint that does not
match the model) raises one of these with the field, file or line, the offending value and
what to do instead. Catch ``MeshtrainError`` to catch them all.
"""

from __future__ import annotations


class MeshtrainError(Exception):
    """Base class of every error meshtrain raises on purpose."""


class ConfigError(MeshtrainError, ValueError):
    """A config value, key or combination is invalid; the message names its path."""


class TopologyError(MeshtrainError, ValueError):
    """The requested mesh does not fit the world (pp * dp * tp != world size, ...)."""


class DistributedError(MeshtrainError, RuntimeError):
    """A distributed set-up or collective problem (missing environment, timeout, ...)."""


class CheckpointError(MeshtrainError, RuntimeError):
    """A checkpoint is missing, truncated, corrupted or belongs to a different model."""


class DataError(MeshtrainError, ValueError):
    """A data file or row is malformed; the message names the file and line."""


class TrainingError(MeshtrainError, RuntimeError):
    """Training cannot continue (e.g. fp16 loss scale stuck at its minimum)."""


class ServeError(MeshtrainError, ValueError):
    """``meshtrain serve`` cannot start: the model, tokenizer or task given does not fit."""
