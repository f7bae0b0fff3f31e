"""The scheduler-side planner, by example and against a naive model of an engine and a daemon."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate_vllm.keys import block_keys
from kvgate_vllm.plan import Planner, Scheduled, Transfer
from kvgate_vllm.protocol import Found

BS = 4


def held_lookup(held: set[int], host: set[int] | None = None, pin: bool = True):
    calls = []

    def lookup(keys):
        calls.append(list(keys))
        n = 0
        while n < len(keys) and keys[n] in held:
            n += 1
        h = 0
        while h < n and (host is None or keys[h] in host):
            h += 1
        return Found(h, n, n if pin else 0)

    lookup.calls = calls
    return lookup


def test_a_prefix_held_by_the_daemon_is_loaded_into_the_blocks_after_the_gpu_hit():
    tokens = list(range(30))  # 7 full blocks, 2 tokens over
    keys = block_keys("m", tokens, BS)
    p = Planner(BS)
    lookup = held_lookup(set(keys[:5]), host=set(keys[:3]))
    # The GPU holds block 0; the daemon blocks 1..4.
    assert p.match("r", "m", tokens, None, BS, lookup) == 4 * BS
    # From the chain's first block (refreshing what the GPU holds), never the last token's.
    assert lookup.calls == [keys[0:7]]
    assert p.hit_sources("r", 4 * BS) == (2 * BS, 2 * BS)
    p.allocated("r", 4 * BS)
    table = [10, 11, 12, 13, 14, 15, 16, 17]
    loads, saves, unpins = p.step([Scheduled("r", 5 * BS, 10, lambda: table)])
    assert loads == [Transfer("r", keys[1:5], [11, 12, 13, 14])]
    # This step computes tokens 20..29: blocks 5 and 6 become full and are offloaded after 4.
    assert saves == [Transfer("r", keys[5:7], [15, 16], keys[4])]
    assert unpins == []
    assert p.step([]) == ([], [], [])
    # Two steps after the load step, its pins are released (the load has run by then).
    assert p.step([]) == ([], [], [keys[0:5]])
    assert p.finished("r") == []


def test_pins_are_released_two_steps_after_the_load_or_when_the_request_finishes():
    tokens = list(range(17))
    keys = block_keys("m", tokens, BS)
    p = Planner(BS)
    lookup = held_lookup(set(keys))
    assert p.match("r", "m", tokens, None, 0, lookup) == 4 * BS
    assert p.match("r", "m", tokens, None, 0, lookup) == 4 * BS  # asked again: pinned again
    p.allocated("r", 4 * BS)
    assert p.step([Scheduled("r", 4 * BS, 1, lambda: list(range(5)))])[2] == []
    assert p.step([])[2] == []
    assert p.step([])[2] == [keys[:4], keys[:4]]
    # A request that finishes before its load step releases its pins then.
    p.match("q", "m", tokens, None, 0, lookup)
    assert p.finished("q") == [keys[:4]]


def test_nothing_is_matched_without_a_daemon_or_for_short_or_unaligned_prompts():
    p = Planner(BS)
    assert p.match("a", "m", list(range(20)), None, 0, lambda keys: None) == 0
    assert p.match("b", "m", list(range(4)), None, 0, held_lookup(set())) == 0
    assert p.match("c", "m", list(range(20)), None, 2, held_lookup(set())) == 0
    assert p.match("d", "m", [], None, 0, held_lookup(set())) == 0


def test_blocks_the_gpu_holds_but_the_daemon_lost_are_offloaded_again():
    tokens = list(range(26))
    keys = block_keys("m", tokens, BS)
    p = Planner(BS)
    # The GPU holds blocks 0..3; the daemon (restarted) only block 0.
    assert p.match("r", "m", tokens, None, 4 * BS, held_lookup(set(keys[:1]))) == 0
    p.allocated("r", 0)
    loads, saves, _ = p.step([Scheduled("r", 4 * BS, 10, lambda: list(range(7)))])
    assert loads == []
    assert saves == [Transfer("r", keys[1:6], [1, 2, 3, 4, 5], keys[0])]


def test_an_admission_with_fewer_external_tokens_loads_only_those():
    tokens = list(range(20))
    keys = block_keys("m", tokens, BS)
    p = Planner(BS)
    p.match("r", "m", tokens, None, 0, held_lookup(set(keys)))
    p.allocated("r", 2 * BS)
    loads, saves, _ = p.step([Scheduled("r", 2 * BS, 12, lambda: list(range(5)))])
    assert loads == [Transfer("r", keys[:2], [0, 1])]
    assert saves == [Transfer("r", keys[2:5], [2, 3, 4], keys[1])]


@st.composite
def workloads(draw):
    prefixes = [draw(st.lists(st.integers(0, 3), min_size=0, max_size=12)) for _ in range(3)]
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 3), min_size=1, max_size=14))
        gpu_blocks = draw(st.integers(0, 4))
        chunks = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
        decode = draw(st.integers(0, 9))
        pin = draw(st.booleans())
        requests.append((prompt, gpu_blocks, chunks, decode, pin))
    return requests


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_every_block_is_loaded_or_offloaded_exactly_as_a_naive_model_says(requests):
    daemon: set[int] = set()
    p = Planner(BS)
    for n, (prompt, gpu_blocks, chunks, decode, pin) in enumerate(requests):
        rid = f"r{n}"
        tokens = list(prompt)
        keys = block_keys("m", tokens, BS)
        limit = (len(tokens) - 1) // BS
        gpu = min(gpu_blocks, limit)
        lookup = held_lookup(set(daemon), pin=pin)
        ext = p.match(rid, "m", tokens, None, gpu * BS, lookup)
        # The naive answer: the daemon's leading blocks from the first, short of the last token;
        # the engine loads those after its GPU hit.
        held0 = 0
        while held0 < limit and keys[held0] in daemon:
            held0 += 1
        held = max(0, held0 - gpu)
        assert ext == held * BS
        p.allocated(rid, ext)
        table = [1000 * n + i for i in range(len(tokens) // BS + decode // BS + 2)]
        computed = (gpu + held) * BS
        loaded: list[Transfer] = []
        saved: list[Transfer] = []
        pins: list[list[int]] = []
        # Prefill in chunks, then decode one token a step (appended after the step, as vLLM does).
        schedule = []
        left = len(tokens) - computed
        for c in chunks:
            if left <= 0:
                break
            schedule.append(min(c, left))
            left -= schedule[-1]
        if left > 0:
            schedule.append(left)
        schedule += [1] * decode
        for count in schedule:
            reads = []
            loads, saves, unpins = p.step(
                [Scheduled(rid, computed, count, lambda: reads.append(1) or table)]
            )
            # The block table is read only by a step that loads or offloads.
            assert len(reads) == (1 if loads or saves else 0)
            loaded += loads
            saved += saves
            pins += unpins
            computed += count
            if computed >= len(tokens):
                tokens.append(7)  # a sampled token joins the sequence
            for s in saves:
                daemon.update(s.keys)
        pins += p.step([])[2] + p.step([])[2] + p.finished(rid)
        final_keys = block_keys("m", tokens, BS)
        # Loaded: exactly the blocks the lookup found, into their own GPU blocks.
        if held:
            assert loaded == [Transfer(rid, keys[gpu : gpu + held], table[gpu : gpu + held])]
        else:
            assert loaded == []
        # Offloaded: every block computed here, once, in chain order, each after its parent.
        full = min(computed, len(tokens)) // BS
        flat = [k for s in saved for k in s.keys]
        # (Blocks the GPU held and the daemon lacked are offloaded too.)
        assert flat == final_keys[min(gpu, held0) : gpu] + final_keys[gpu + held : full]
        for s in saved:
            i = final_keys.index(s.keys[0])
            assert s.parent == (final_keys[i - 1] if i else None)
            assert s.block_ids == table[i : i + len(s.keys)]
        # Pins: every pinning lookup's keys released exactly once.
        expected = Counter(tuple(c[:held0]) for c in lookup.calls if pin and held0)
        assert Counter(tuple(k) for k in pins) == expected
    assert len(p) == 0
