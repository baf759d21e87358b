"""Free loopback ports for the servers a test starts: never the same port twice in one test process.

The kernel's answer to bind(0) is free only until somebody binds it. A test that starts several engines at once
asks for three ports each before any of them binds, and the kernel may hand a just-released port out again: an
engine of such a batch died with `HTTP port … is already in use by python3`, most likely its neighbour's port."""

from __future__ import annotations

import socket

_GIVEN: set[int] = set()  # every port handed out by this process


def free_port() -> int:
    """A loopback port free now and not handed out before by this process."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
