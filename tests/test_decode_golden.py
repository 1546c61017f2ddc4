"""Today's searches return what the searches of 2026-11-26 (commit bc74487) returned, before
they were made faster (issue 26): the same tokens, and scores equal to float32 rounding (2e-5
relative: a sentence's sharp log-probs summed in another order drift by up to 8e-6), on tiny
random Transformers (post-LN, pre-LN, Marian's options) for greedy decoding and beam
search of several widths and length penalties, `best_only` included. The recording and the
cases are in `tests/decode_golden.py`."""

from __future__ import annotations

import numpy as np
import pytest
from decode_golden import MAX_LEN, PATH, cases, decode_case

CASES = list(cases())


@pytest.fixture(scope="module")
def recorded():
    with np.load(PATH) as arrays:
        return dict(arrays)


# The searches' default (one cache stage here: MAX_LEN is under cache_stages' first 16), and
# a cache grown twice on the way (4 -> 8 -> MAX_LEN positions).
STAGES = (None, (4, 8, MAX_LEN))


@pytest.mark.parametrize("stages", STAGES, ids=["default", "grown"])
@pytest.mark.parametrize("key, name, seed, kwargs", CASES, ids=[c[0] for c in CASES])
def test_search_returns_the_recorded_tokens_and_scores(recorded, key, name, seed, kwargs, stages):
    now = decode_case(name, seed, kwargs, stages)
    np.testing.assert_array_equal(now["tokens"], recorded[f"{key}/tokens"])
    if "scores" in now:
        np.testing.assert_allclose(now["scores"], recorded[f"{key}/scores"], rtol=2e-5, atol=1e-5)
