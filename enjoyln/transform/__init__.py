"""Transformations: apply a ``FoldPlan`` to a model in memory (center, untie, fuse, swap, rotate), and training with CBWC."""
