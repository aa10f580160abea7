"""Checks that a converted model computes what the original does: static (every weight) and forward
(the outputs)."""
