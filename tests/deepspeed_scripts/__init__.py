"""DeepSpeed scripts as users write them, run by meshtrain (and by DeepSpeed)."""
