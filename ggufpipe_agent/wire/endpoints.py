"""Endpoints as the inventory, --listen and a Hello write them: ``unix:PATH`` or
``[tcp:]HOST:PORT``."""

from __future__ import annotations


def parse_endpoint(endpoint: str) -> tuple[str, int | None]:
    """``unix:PATH`` -> (PATH, None); ``[tcp:]HOST:PORT`` -> (HOST, PORT), the
    host 127.0.0.1 when left out. The one parser of endpoints: the bridge,
    ``--listen`` and the orchestrator's transports all use it."""
    if endpoint.startswith("unix:"):
        if not endpoint[5:]:
            raise ValueError(f"{endpoint!r}: unix: needs a socket path")
        return endpoint[5:], None
    host, colon, port = endpoint.removeprefix("tcp:").rpartition(":")
    if not colon or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{endpoint!r} is not HOST:PORT or unix:PATH")
    return host or "127.0.0.1", int(port)
