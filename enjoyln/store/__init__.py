"""One model directory on disk: open, validate and read it, publish an output, and load a folded
one."""
