"""Analysis: trace a model, decide which LayerNorms fold and what folding them needs (a ``FoldPlan``)."""
