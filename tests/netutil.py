"""Helpers shared by the multi-process tests."""
import socket


def free_port() -> int:
    """A TCP port free on loopback right now, for a rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
