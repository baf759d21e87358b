"""Free loopback ports for the servers a test starts: never the same port twice in one test process.

The kernel's answer to bind(0) is free only until somebody binds it. A test that starts several engines at once
asks for three ports each before any of them binds, and the kernel may hand a just-released port out again: an
engine of such a batch died with `HTTP port … is already in use by python3`, most likely its neighbour's port."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

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


def late_bound_port() -> int:
    """A loopback port for a listener that binds long after the port is chosen (vLLM's NIXL side channel binds once
    the model is loaded): one below the kernel's ephemeral range, free now and not handed out before.

    A port from bind(0) is in the ephemeral range, which the kernel hands out again to any bind(0) and to the local
    end of any outgoing connection: while a vLLM engine loaded, its side-channel port was taken so
    (`zmq.error.ZMQError: Address already in use`), and the engine never became healthy. Below the range only an
    explicit bind can take it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picker = random.Random(os.getpid())
    while True:
        port = picker.randrange(10000, low)
        if port in _GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
