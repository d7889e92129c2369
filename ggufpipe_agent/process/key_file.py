"""The listen key: how a hand-started agent (``--listen``) and its orchestrator
prove to each other that they hold the same secret, without sending it.

The agent creates a fresh 256-bit key when it starts, in a file only its user
can read (0600 in a 0700 directory), and prints the file's path. The
orchestrator reads that file where the agent runs (over SSH, or directly on
this machine) and the two run a challenge-response before anything else
crosses the connection (docs/security.md)::

    agent -> orchestrator   AuthChallenge{protocol, nonce_a}
    orchestrator -> agent   AuthResponse{nonce_o, HMAC(key, "orchestrator" | nonce_a | nonce_o)}
    agent -> orchestrator   AuthProof{HMAC(key, "agent" | nonce_a | nonce_o)}    then Hello

Each side checks the other's proof over both fresh nonces, so a proof cannot
be replayed or reflected, and whoever binds the port first learns nothing it
could use: neither side ever sends the key, and the agent sends nothing but
its challenge until the orchestrator has proved itself.

The handshake's proofs and the key file's reading are shared with the
orchestrator (:mod:`ggufpipe_agent.wire.listen_key`); writing the key file
is the agent's.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from ggufpipe_agent.wire.listen_key import (
    AGENT,
    KEY_BYTES,
    KEY_DIR,
    NONCE_BYTES,
    ORCHESTRATOR,
    ListenKeyError,
    default_key_path,
    new_nonce,
    parse_key,
    proof,
    read_key_file,
    verify,
)

__all__ = [
    "AGENT",
    "KEY_BYTES",
    "KEY_DIR",
    "NONCE_BYTES",
    "ORCHESTRATOR",
    "ListenKeyError",
    "default_key_path",
    "new_nonce",
    "parse_key",
    "proof",
    "read_key_file",
    "remove_key_file",
    "verify",
    "write_key_file",
]


def _private_directory(directory: Path) -> None:
    """Create ``directory`` 0700 if needed; refuse one another user owns or
    others can write to (they could swap the key file under the agent)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise ListenKeyError(f"{directory} is not a directory")
    if info.st_uid != os.getuid():
        raise ListenKeyError(f"{directory} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        raise ListenKeyError(
            f"{directory} is writable by others (mode {stat.S_IMODE(info.st_mode):04o}); chmod 700 it"
        )


def write_key_file(path: Path) -> bytes:
    """A new key, written 0600 to ``path`` (atomically: a temporary created
    with O_EXCL|O_NOFOLLOW, then renamed over whatever was there)."""
    _private_directory(path.parent)
    key = secrets.token_bytes(KEY_BYTES)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    descriptor = os.open(temporary, flags, 0o600)
    try:
        with os.fdopen(descriptor, "w", encoding="ascii") as handle:
            handle.write(key.hex() + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return key


def remove_key_file(path: Path, key: bytes) -> None:
    """Remove ``path`` if it still holds ``key`` (not a later agent's)."""
    try:
        if parse_key(path.read_bytes(), str(path)) == key:
            path.unlink()
    except (OSError, ListenKeyError):
        pass
