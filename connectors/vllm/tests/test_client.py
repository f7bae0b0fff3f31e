"""The client against a real kvgate-kvbm daemon."""

import os

import pytest

from kvgate_vllm.client import Client, ConnectionLost, Reconnecting, Segment
from kvgate_vllm.keys import block_keys
from kvgate_vllm.protocol import DaemonError, Found, Layout

BB = 64
LAYOUT = Layout(model="m", dtype="bfloat16", layers=2, block_size=4, block_bytes=BB)


def fill(seg: Segment, slot: int, byte: int) -> None:
    seg.view(slot * BB, BB)[:] = bytes([byte]) * BB


def test_blocks_offloaded_come_back_byte_for_byte_in_another_connection(daemon):
    keys = block_keys("m", list(range(40)), 4)
    seg = Segment(len(keys) * BB)
    a = Client(daemon.socket, LAYOUT, seg)
    for i in range(len(keys)):
        fill(seg, i, i + 1)
    done = a.offload(None, [(k, i * BB) for i, k in enumerate(keys)])
    assert (done.stored, done.present, done.skipped) == (10, 0, 0)
    assert a.offload(None, [(keys[0], 0)]).present == 1

    seg2 = Segment(len(keys) * BB)
    b = Client(daemon.socket, LAYOUT, seg2)
    assert b.lookup(keys) == Found(host=10, any=10, pinned=0)
    # A chain is looked up from its first key: an unknown key stops it.
    assert b.lookup([1] + keys).any == 0
    got = b.onboard([(k, i * BB) for i, k in enumerate(keys)])
    assert (got.blocks, got.from_host) == (10, 10)
    assert bytes(seg2.view(0, len(keys) * BB)) == bytes(seg.view(0, len(keys) * BB))
    a.close(), b.close(), seg.close(), seg2.close()


def test_requests_over_4096_blocks_are_sent_in_chunks_that_continue_the_chain(daemon):
    keys = block_keys("m", list(range(4 * 5000)), 4)
    seg = Segment(len(keys) * BB)
    c = Client(daemon.socket, LAYOUT, seg)
    assert c.offload(None, [(k, i * BB) for i, k in enumerate(keys)]).stored == 5000
    assert c.lookup(keys, pin_ms=60_000) == Found(5000, 5000, 5000)
    assert c.unpin(keys) == 5000
    assert c.onboard([(k, i * BB) for i, k in enumerate(keys)]).blocks == 5000
    c.close(), seg.close()


def test_a_slot_outside_the_segment_is_refused_and_the_connection_lives_on(daemon):
    seg = Segment(BB)
    c = Client(daemon.socket, LAYOUT, seg)
    with pytest.raises(DaemonError) as e:
        c.offload(None, [(1, BB)])
    assert e.value.code == "slot"
    assert c.connected and c.lookup([1]).any == 0
    c.close(), seg.close()


def test_a_layout_of_another_model_is_refused_at_registration(daemon):
    seg = Segment(BB)
    with pytest.raises(DaemonError) as e:
        Client(daemon.socket, Layout("other", "bfloat16", 2, 4, BB), seg)
    assert e.value.code == "layout"
    seg.close()


def test_no_daemon_is_a_connection_error(tmp_path):
    seg = Segment(BB)
    with pytest.raises(ConnectionLost, match="cannot connect"):
        Client(str(tmp_path / "none.sock"), LAYOUT, seg)
    seg.close()


def test_the_reconnecting_client_survives_a_daemon_restart(daemon):
    now = [0.0]
    r = Reconnecting(daemon.socket, LAYOUT, 4 * BB, retry_s=5.0, clock=lambda: now[0])
    keys = block_keys("m", list(range(16)), 4)
    fill(r.segment, 0, 7)
    assert r.call(lambda c: c.offload(None, [(keys[0], 0)])).stored == 1
    assert r.connects == 1

    daemon.stop()
    assert r.call(lambda c: c.lookup(keys)) is None
    assert r.failures == 1
    daemon.start()
    # Within the back-off nothing is tried: the engine is not slowed by a daemon that is away.
    assert r.call(lambda c: c.lookup(keys)) is None
    assert r.connects == 1
    now[0] += 5.0
    # The new daemon starts empty; the client registered again on its own.
    assert r.call(lambda c: c.lookup(keys)) == Found(0, 0, 0)
    assert r.connects == 2
    r.close()


def test_segments_are_memfds_the_daemon_accepts_and_bounded_views(daemon):
    seg = Segment(2 * BB)
    assert os.readlink(f"/proc/self/fd/{seg.fd}").startswith("/memfd:")
    with pytest.raises(ValueError, match="outside"):
        seg.view(BB, 2 * BB)
    seg.close()


def test_a_daemon_that_hangs_is_tried_less_and_less_often(tmp_path):
    import socket as socketlib
    import threading

    # A listener that accepts and never answers: each try costs one timeout.
    path = str(tmp_path / "hung.sock")
    listener = socketlib.socket(socketlib.AF_UNIX)
    listener.bind(path)
    listener.listen(16)
    accepted = []

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    now = [0.0]
    r = Reconnecting(path, LAYOUT, BB, timeout_s=0.1, retry_s=1.0, max_retry_s=4.0, clock=lambda: now[0])
    tries = []
    for t in [0, 0.5, 1, 2, 3, 6, 7, 11, 14, 15]:
        now[0] = t
        assert r.call(lambda c: c.lookup([1])) is None
        tries.append(len(accepted))
    # Tried at 0, 1 (after 1 s), 3 (2 s), 7 (4 s), 11 (capped at 4 s), 15.
    assert tries == [1, 1, 2, 2, 3, 3, 4, 5, 5, 6]
    listener.close()
    r.close()
