import pytest

from kvgate_vllm.counters import COUNTERS, Counts, merge


def test_take_returns_the_counts_since_the_last_take():
    c = Counts()
    c.add("lookups")
    c.add("loaded_blocks", 41)
    c.add("loaded_blocks", 0)
    assert c.take() == {"lookups": 1, "loaded_blocks": 41}
    assert c.take() == {}


def test_unknown_counters_are_refused():
    with pytest.raises(KeyError):
        Counts().add("typo")


def test_merge_sums_per_name():
    assert merge({"lookups": 1, "loaded_blocks": 2}, {"loaded_blocks": 3, "offloaded_blocks": 4}) == {
        "lookups": 1, "loaded_blocks": 5, "offloaded_blocks": 4}
    assert all(name.replace("_", "").isalpha() for name in COUNTERS)
