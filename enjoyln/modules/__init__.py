"""The modules a fold puts into a model: ``RMSNorm``, ``GroupRMSNorm`` and the auxiliary-centering
hooks."""
