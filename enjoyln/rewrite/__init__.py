"""The checkpoint rewrite: the plan for a directory, what the fold writes for it tensor by tensor, the
writer, and the fold itself (``convert``): a directory in, a checked directory out."""
