"""bench.py identity: the bf16 identity count: where two greedy replies first differ."""

from benchmarks.engine_checks import first_difference


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one reply stopped early
