import msgspec
import pytest

from kvgate_vllm import protocol as p


def body(frame: bytes) -> bytes:
    assert p.body_len(frame[:4]) == len(frame) - 4
    return frame[4:]


def test_requests_are_named_maps_tagged_by_op():
    layout = p.Layout("m", "bfloat16", 2, 16, 4096)
    msg = msgspec.msgpack.decode(body(p.frame(p.register(layout, 8192))))
    assert msg == {
        "op": "register",
        "layout": {"model": "m", "dtype": "bfloat16", "layers": 2, "block_size": 16,
                   "block_bytes": 4096, "shard": 0, "shards": 1},
        "segment_bytes": 8192,
    }
    big = 0xFFFF_FFFF_FFFF_FFFF
    msg = msgspec.msgpack.decode(body(p.frame(p.offload(None, [(big, 0), (1, 4096)]))))
    assert msg == {"op": "offload", "parent": None,
                   "blocks": [{"key": big, "offset": 0}, {"key": 1, "offset": 4096}]}
    assert msgspec.msgpack.decode(body(p.frame(p.lookup([1, 2], 50)))) == {
        "op": "lookup", "keys": [1, 2], "pin_ms": 50}


def test_requests_over_the_bounds_are_refused_before_sending():
    with pytest.raises(ValueError, match="4097 keys"):
        p.lookup(list(range(4097)))
    with pytest.raises(ValueError, match="4097 blocks"):
        p.onboard([(k, 0) for k in range(4097)])


def test_responses_decode_with_their_defaults():
    enc = msgspec.msgpack.encode
    assert p.decode(enc({"op": "found", "host": 1, "any": 3}), "found") == p.Found(1, 3, 0)
    assert p.decode(enc({"op": "onboarded", "blocks": 2, "from_host": 1, "from_remote": 1}),
                    "onboarded") == p.Onboarded(2, 1, 0, 1, 0)
    assert p.decode(enc({"op": "onboarded", "blocks": 3, "from_host": 1, "from_remote": 0,
                         "from_disk": 0, "from_peer": 2}), "onboarded") == p.Onboarded(3, 1, 0, 0, 2)
    assert p.decode(enc({"op": "offloaded", "stored": 1, "present": 2}), "offloaded") == p.Offloaded(1, 2, 0)


def test_bad_responses_raise_typed_errors():
    enc = msgspec.msgpack.encode
    with pytest.raises(p.DaemonError) as e:
        p.decode(enc({"op": "error", "code": "slot", "message": "outside"}), "onboarded")
    assert e.value.code == "slot" and not e.value.closes_connection
    with pytest.raises(p.ProtocolError, match="expected 'found'"):
        p.decode(enc({"op": "unpinned", "blocks": 1}), "found")
    with pytest.raises(p.ProtocolError, match="not a count"):
        p.decode(enc({"op": "found", "host": -1, "any": 0}), "found")
    with pytest.raises(p.ProtocolError, match="undecodable"):
        p.decode(b"\xc1", "found")
    with pytest.raises(p.ProtocolError, match="not a map"):
        p.decode(enc([1]), "found")
    with pytest.raises(p.ProtocolError, match="limit"):
        p.body_len((p.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
