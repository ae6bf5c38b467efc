"""Tests of ``meshtrain train``: its config layers, its corpus, and the job end to end."""
