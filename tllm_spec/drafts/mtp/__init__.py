"""MTP modules: their model, checkpoint layouts, one-model workers and relaxed acceptance."""
