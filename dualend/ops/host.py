"""This host as servers and clients on it see it: the address a client dials, free ports, files
only their owner reads."""
from __future__ import annotations

import errno
import socket
from pathlib import Path


UNLIMITED_MESSAGES = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# A channel to this host's own tritonserver: once a restarted server listens again (after seconds),
# calls pass within a second, not after gRPC's default reconnect backoff (x1.6 a try, up to 120 s)
TO_LOCAL_SERVER = UNLIMITED_MESSAGES + [("grpc.initial_reconnect_backoff_ms", 100),
                                        ("grpc.max_reconnect_backoff_ms", 1000)]


def client_host(host: str) -> str:
    """Where a client on this machine connects to a server bound to `host` (wildcard binds are
    reached via loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports that are free on `host` now (held open together while choosing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on `port` of `host` now (a port left in TIME_WAIT counts as free, as
    it does for servers that bind with SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def write_private_file(path: Path, text: str) -> None:
    """A file only its owner reads (keys, secrets), its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)
