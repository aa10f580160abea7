"""The fold itself (``convert``), above the gate it calls: a model directory in, its entries written
by ``writer``, checked, and published as a folded directory."""
