"""meshtrain plan: the layout that fits and runs fastest (docs/plan.md)."""
