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
"""

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


class CredentialError(GgufpipeError):
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
        raise CredentialError(f"{where} is not a ggufpipe listen key (expected {KEY_BYTES * 2} hex digits)")
    return key


def _private_directory(directory: Path) -> None:
    """Create ``directory`` 0700 if needed; refuse one another user owns or
    others can write to (they could swap the key file under the agent)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise CredentialError(f"{directory} is not a directory")
    if info.st_uid != os.getuid():
        raise CredentialError(f"{directory} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        raise CredentialError(
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
    except (OSError, CredentialError):
        pass


def read_key_file(path: Path) -> bytes:
    """A key file on this machine, checked like ssh checks a private key: a
    regular file of ours that nobody else can read."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        raise CredentialError(f"cannot read the listen key {path}: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise CredentialError(f"{path} is not a regular file of this user")
        if info.st_mode & 0o077:
            raise CredentialError(
                f"{path} is readable by others (mode {stat.S_IMODE(info.st_mode):04o}); "
                "it is not the key file an agent wrote"
            )
        return parse_key(handle.read(4096), str(path))
