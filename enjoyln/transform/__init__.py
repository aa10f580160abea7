"""Transformations: apply a ``FoldPlan`` to a model in memory, and training with CBWC."""
