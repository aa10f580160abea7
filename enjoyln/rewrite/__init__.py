"""The checkpoint rewrite (``convert``): a model directory in, a checked folded directory out."""
