from kvgate_vllm.keys import KeyChain, block_keys, seed, vllm_salt_extra_key

TOKENS = list(range(1, 65))


def test_the_keys_are_the_rust_implementations():
    # The same values as kvgate_kv_events::key's `keys_match_the_python_connectors_golden_values`.
    assert block_keys("tiny", TOKENS, 32) == [0x0FC227E95BB2E74F, 0x083008A9C2907837]
    assert block_keys("tiny", TOKENS, 32, "s1") == [0x63E1920F49CBAB14, 0xC853CC2A069DD863]


def test_a_partial_last_block_has_no_key():
    assert len(block_keys("tiny", TOKENS[:63], 32)) == 1
    assert block_keys("tiny", TOKENS[:31], 32) == []


def test_a_chain_fed_growing_prefixes_equals_the_one_off_keys():
    chain = KeyChain("m", 4)
    for n in range(0, 41, 3):
        chain.advance(TOKENS[:n])
    assert chain.keys == block_keys("m", TOKENS[:39], 4)


def test_keys_depend_on_model_salt_and_every_earlier_token():
    base = block_keys("m", TOKENS, 8)
    assert block_keys("n", TOKENS, 8)[0] != base[0]
    assert block_keys("m", TOKENS, 8, "s")[0] != base[0]
    changed = [7] + TOKENS[1:]
    assert all(a != b for a, b in zip(block_keys("m", changed, 8), base))
    # A change in block 2 leaves blocks 0 and 1 alone.
    later = TOKENS[:16] + [0] + TOKENS[17:]
    assert block_keys("m", later, 8)[:2] == base[:2]
    assert block_keys("m", later, 8)[2] != base[2]


def test_the_salt_is_an_extra_key_of_block_zero_not_the_seed():
    assert vllm_salt_extra_key("s") == b"\x91\xa1s"
    assert seed("m") == seed("m", None) == seed("m", "")
