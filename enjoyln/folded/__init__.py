"""What the fold of a checkpoint must be: the plan for a directory (``planning``), the config a fold
writes (``config``), the folded tensors streamed by key (``stream``). The gate (``checking``) and
the writer (``rewrite``) both read it, so the static check's expected tensors are the writer's
bytes."""
