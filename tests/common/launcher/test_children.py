import socket

from tandem.common.launcher.children import _ephemeral_range, free_port


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    """A port bound to 0 elsewhere (a UCX listener, an outgoing connection) can never be the one picked."""
    low, high = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_an_ephemeral_bind_never_lands_on_a_picked_port():
    picked = {free_port() for _ in range(50)}
    held = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        assert not picked & {s.getsockname()[1] for s in held}
    finally:
        for s in held:
            s.close()
