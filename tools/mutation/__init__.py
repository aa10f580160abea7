"""Seeded mutations of a folded model directory, each with the verdict a sound gate must give.

``enjoyln check REFERENCE CANDIDATE`` is a CI gate: exit 0 must mean "CANDIDATE
computes what REFERENCE does". This module measures that. From a seed it draws
mutations of checked folds:

- a weight element (of any stored tensor, loaded or not) set to NaN, ±Inf,
  ±0 or a denormal, or nudged by one ulp or by a relative 1e-3;
- the safetensors file itself (its header's metadata, a tensor's dtype or
  shape, two tensors' names swapped, bytes added or cut);
- a config key (top level, nested, or in the ``enjoyln`` block) changed to
  another value, retyped (``1`` for ``true``), deleted, or added;
- any other file changed by a byte, truncated, replaced, edited as JSON, or
  removed, and files added;
- inert changes, which must pass: ``config.json`` re-serialised with other
  whitespace and key order, other JSON files re-spaced (every token kept), the
  ``enjoyln`` block's ``version`` string, VCS data, a FIFO, a link out of the
  directory, a file's mtime, the weights written in another tensor order or
  in two shards, and needed files served through links out of the directory
  (the Hugging Face cache layout);
- what else decides a verdict (``gate_inputs``): a plan cache entry planted where
  enjoyln up to 0.1.0 read one (``$ENJOYLN_CACHE/plans/<key>.json``, the key computed
  as it did, the gate run with that environment, half of the time with ``--static``),
  agreeing with a candidate whose
  block drops a centering or moves its axis (fail); the dtype a model loads in, which
  transformers 5 takes from config.json's ``dtype``, else the index metadata's, else
  the first floating tensor by sorted name: that tensor widened with the config's
  ``dtype`` deleted (fail: it loads in float64), any tensor widened with it kept
  (pass), the ``dtype`` deleted alone (fail: a deleted key); the weights in two
  shards with the index's metadata dropped (fail: from_pretrained cannot load),
  its ``dtype`` changed beside the config's (pass) or without it (fail), its
  ``total_size`` changed (pass); the fold cast to bfloat16 and checked with
  ``--dtype bfloat16``: rounded to nearest (pass), folded tensors rounded toward
  +inf, -inf or zero, or one element one ulp off (fail); a loaded tensor removed
  from the file (fail: transformers initialises it).

The sources include a BertModel saved without its pooler, which every load
initialises at random: its unmutated fold and inert changes must pass.

Every mutation carries the verdict it must get (``"fail"``: exit non-zero;
``"pass"``: exit 0) and the reason. The policy: the gate fails every mutation
that changes what ``from_pretrained`` or ``enjoyln.load`` computes; every
weight byte is verified; ``config.json`` is compared as parsed JSON values
(a JSON value of another type is another value); the ``enjoyln`` block must be
what the confirmed plan gives, its ``version`` string aside; every other file is
compared by content, whatever its name; extra or missing files fail, except
what a fold itself skips. ``ground`` says why a "fail" is owed: the mutation
changes a loaded tensor (``weights-loaded``), a config value transformers reads
(``config-read``), the plan ``enjoyln.load`` reads (``plan-read``), a file a loader
of this directory reads (``file-read``: the change may still fall where the reader
looks past it, such as a count PhoBERT drops or two keys of a JSON object), the
directory's layout a loader needs (``layout``), or nothing shown to be read: only
the policy (``policy``). A pass is owed to a change proven inert (``inert``) or to
another form of the same fold (``equivalent``: the plain form without a block, or
the fold cast to another dtype under ``--dtype``).

The expectations are derived from the files (safetensors headers, JSON), never
from the gate's code. :func:`observe` loads a directory as a user would
(``from_pretrained``, ``enjoyln.load``, the tokenizer, the image processor) and
fingerprints what they compute, bit for bit: an inert mutation is one whose
fingerprint is the unmutated fold's (``tests/testing/test_mutation.py`` proves each
kind), and a claimed change is confirmed the same way.

>>> from tools.mutation.sources import build_sources  # doctest: +SKIP
>>> from tools.mutation.drawing import draw  # doctest: +SKIP
>>> from tools.mutation.judging import judge_all, score  # doctest: +SKIP
>>> sources = build_sources("/tmp/mutation-sources")  # doctest: +SKIP
>>> results = judge_all(sources, draw(sources, n=500, seed=0), workers=2)  # doctest: +SKIP
>>> score(results)["all"]["score"]  # doctest: +SKIP
1.0
"""
