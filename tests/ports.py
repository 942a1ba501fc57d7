"""A free TCP port on 127.0.0.1 for a test that must name its rendezvous port before the processes start.

Why not bind port 0 and take what the OS gives: that port comes from the ephemeral range, the same range the OS
draws from for every outgoing connection (gloo's pairs, TCPStore clients). Between closing the probe and the
launcher binding the port, a connection of a test running beside this one (pytest-xdist runs two) can take it,
and the rendezvous fails with "address already in use". A port below the ephemeral range is never handed out
that way; it is drawn at random and checked free, so two workers collide only by choosing the same one.
"""

from __future__ import annotations

import random
import socket


def _ephemeral_low(default: int = 32768) -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port() -> int:
    """A port in [10000, the ephemeral range's start) that nothing on 127.0.0.1 listens on now."""
    high = max(10001, _ephemeral_low())
    for _ in range(200):
        port = random.randrange(10000, high)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found in 10000..{high - 1} on 127.0.0.1")
