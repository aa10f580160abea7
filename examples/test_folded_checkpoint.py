"""A pytest gate for a folded checkpoint: copy into your test suite and set the paths.

ORIGINAL=models/original FOLDED=models/folded pytest examples/test_folded_checkpoint.py
"""

import os

import pytest

import enjoyln

ORIGINAL = os.environ.get("ORIGINAL", "models/original")
FOLDED = os.environ.get("FOLDED", "models/folded")


@pytest.mark.skipif(
    not (os.path.isdir(ORIGINAL) and os.path.isdir(FOLDED)),
    reason="set ORIGINAL and FOLDED to two model directories",
)
def test_folded_checkpoint_matches_original():
    # every weight first (streamed, any size), then the outputs; mode="static" skips the forward
    # pass
    report = enjoyln.check_checkpoints(ORIGINAL, FOLDED)
    assert report.passed, report.summary()
