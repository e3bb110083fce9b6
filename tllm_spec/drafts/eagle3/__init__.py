"""The EAGLE-3 draft head: its model, checkpoint dialects and one-model worker."""
