"""Evaluation: scoring a dataset with a lowered model (`evaluate`), the exact metrics as functions
and streaming accumulators (`metrics`, `classes` for multiclass heads), scores from logits
(`scores`) and early stopping (`early_stop`)."""
