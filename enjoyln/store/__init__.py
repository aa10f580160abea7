"""One model directory on disk: open and validate it (``Checkpoint``), read its tensors, copy its other
files, publish an output directory, and load a folded one."""
