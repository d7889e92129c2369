"""The listen key's half both sides run: where an agent on an endpoint keeps
its key, the key file's format and how it is read, and the proofs of the
challenge-response (the agent writes the key: ggufpipe_agent/process/key_file.py,
which describes the exchange)."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from pathlib import Path

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.wire.endpoints import parse_endpoint

KEY_BYTES = 32
NONCE_BYTES = 32
#: Where an agent listening on an endpoint keeps its key unless told otherwise
#: (``--key-file`` on the agent, ``listen_key:`` in the inventory).
KEY_DIR = "~/.local/state/ggufpipe/listen"
ORCHESTRATOR = b"orchestrator"
AGENT = b"agent"
_DOMAIN = b"ggufpipe listen key v1\0"


class ListenKeyError(GgufpipeError):
    """A key file that cannot be created, read or trusted."""


def default_key_path(endpoint: str) -> str:
    """The key file of an agent listening on ``endpoint``, as a path with a
    leading ``~/`` (expanded where the agent runs): the same on both sides."""
    where, port = parse_endpoint(endpoint)
    name = f"tcp-{where}-{port}" if port is not None else f"unix-{where.strip('/')}"
    return f"{KEY_DIR}/{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.key"


def proof(key: bytes, role: bytes, agent_nonce: bytes, orchestrator_nonce: bytes) -> bytes:
    """What ``role`` sends to show it holds ``key`` in this exchange."""
    return hmac.new(key, _DOMAIN + role + b"\0" + agent_nonce + orchestrator_nonce, hashlib.sha256).digest()


def verify(key: bytes, role: bytes, agent_nonce: bytes, orchestrator_nonce: bytes, given: bytes) -> bool:
    return hmac.compare_digest(proof(key, role, agent_nonce, orchestrator_nonce), given)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def parse_key(text: bytes, where: str) -> bytes:
    """The key in a key file's bytes (64 hex digits and a newline)."""
    try:
        key = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ListenKeyError(f"{where} is not a ggufpipe listen key (expected {KEY_BYTES * 2} hex digits)")
    return key


def read_key_file(path: Path) -> bytes:
    """A key file on this machine, checked like ssh checks a private key: a
    regular file of ours that nobody else can read."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        raise ListenKeyError(f"cannot read the listen key {path}: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ListenKeyError(f"{path} is not a regular file of this user")
        if info.st_mode & 0o077:
            raise ListenKeyError(
                f"{path} is readable by others (mode {stat.S_IMODE(info.st_mode):04o}); "
                "it is not the key file an agent wrote"
            )
        return parse_key(handle.read(4096), str(path))
