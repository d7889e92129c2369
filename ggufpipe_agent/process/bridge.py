"""``ggufpipe-agent bridge ENDPOINT``: stdin/stdout <-> a local socket.

Run by the orchestrator as an SSH exec session to reach an agent's data socket
(or a hand-started agent's control socket) on hosts where sshd forbids port
and stream-local forwarding. Kept free of heavy imports: it starts in tens of
milliseconds and only copies bytes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import threading

from ggufpipe_agent.wire.endpoints import parse_endpoint  # noqa: F401 - the bridge takes an endpoint

CHUNK = 1 << 20


def connect(endpoint: str) -> socket.socket:
    where, port = parse_endpoint(endpoint)
    if port is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(where)
        return sock
    return socket.create_connection((where, port))


def _splice(source: int, target: int) -> bool:
    """Copy ``source`` (a pipe) to ``target`` with splice until EOF; False
    when splice cannot be used here (not a pipe, no os.splice), before any
    byte moved. The socket is blocking, so a full socket waits, as sendall does."""
    splice = getattr(os, "splice", None)
    if splice is None:
        return False
    moved_any = False
    while True:
        try:
            count = splice(source, target, CHUNK)
        except OSError as error:
            if not moved_any and error.errno in (errno.EINVAL, errno.ENOSYS, errno.EBADF):
                return False
            raise
        if not count:
            return True
        moved_any = True


def bridge_main(args: list[str]) -> int:
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: ggufpipe-agent bridge unix:PATH | HOST:PORT", file=sys.stderr)
        return 2
    try:
        sock = connect(args[0])
    except (OSError, ValueError) as error:
        print(f"ggufpipe-agent bridge: cannot connect to {args[0]}: {error}", file=sys.stderr)
        return 1
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def upstream() -> None:
        try:
            # splice(2) moves a pipe's pages into the socket without copying
            # them through this process: a stage file sent to the host (GBs)
            # crosses the bridge at a fraction of the CPU of read + sendall.
            if not _splice(0, sock.fileno()):
                while True:
                    data = os.read(0, CHUNK)
                    if not data:
                        break
                    sock.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    try:
        while True:
            count = sock.recv_into(buffer)
            if not count:
                break
            written = 0
            while written < count:
                written += os.write(1, view[written:count])
    except OSError:
        pass
    # The socket side is done (the agent closed it, or went away): end now,
    # whatever the stdin thread is doing.
    os._exit(0)
