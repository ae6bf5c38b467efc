"""Ready-made jobs built on the public API (``meshtrain train`` lives in ``jobs.train``)."""
