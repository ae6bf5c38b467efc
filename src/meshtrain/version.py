"""meshtrain's version, in a module of its own so that the modules that record it (a
checkpoint's manifest) need not import the package root."""

from __future__ import annotations

__version__ = "0.1.0"
