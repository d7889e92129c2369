"""SSH connections for the SSH transport: asyncio-shaped streams over
asyncssh channels, and one shared connection per host (a pool per event loop,
closed when its last stage releases it).

Host keys are checked against known_hosts unless the inventory says
``insecure_no_host_key_check: true``; ~/.ssh/config and ssh-agent apply as
they do for ``ssh``, except that ``UserKnownHostsFile none`` there (which
asyncssh takes as "check nothing") is refused instead of obeyed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from ggufpipe_tui.core.inventory import HostSpec
from ggufpipe_tui.transports.connection import HostUnreachable, TransportError

log = logging.getLogger("ggufpipe.ssh")
# asyncssh logs every channel open and close at INFO; under -v those lines
# would bury the agents' own logs. A level set by the user is kept.
if logging.getLogger("asyncssh").level == logging.NOTSET:
    logging.getLogger("asyncssh").setLevel(logging.WARNING)


# ------------------------------------------------------------------ streams


def _lost(error: asyncssh.Error) -> ConnectionResetError:
    return ConnectionResetError(f"SSH channel lost: {error.reason or type(error).__name__}")


class SshReader:
    """An SSHReader in binary mode that fails like an asyncio stream: a lost
    connection is a ConnectionError (asyncssh raises its own errors, which
    the orchestrator's relays would not recognise)."""

    def __init__(self, inner: asyncssh.SSHReader[bytes]) -> None:
        self._inner = inner
        self.received = 0

    async def readexactly(self, count: int) -> bytes:
        try:
            data = await self._inner.readexactly(count)
        except asyncio.IncompleteReadError as error:
            self.received += len(error.partial)
            raise
        except asyncssh.Error as error:
            raise _lost(error) from error
        self.received += len(data)
        return data

    async def read(self, count: int = -1) -> bytes:
        try:
            data = await self._inner.read(count)
        except asyncssh.Error as error:
            raise _lost(error) from error
        self.received += len(data)
        return data

    async def readline(self) -> bytes:
        try:
            return await self._inner.readline()
        except asyncssh.Error as error:
            raise _lost(error) from error

    def at_eof(self) -> bool:
        return self._inner.at_eof()


class SshWriter:
    """An SSHWriter in binary mode with asyncio's write/drain contract. drain()
    waits while the channel's send buffer is above its high-water mark, and
    asyncssh sends only within the peer's flow-control window: a slow consumer
    on the host holds back this writer."""

    def __init__(self, inner: asyncssh.SSHWriter[bytes]) -> None:
        self._inner = inner

    def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self._inner.write(data if isinstance(data, bytes) else bytes(data))
        except asyncssh.Error as error:
            raise _lost(error) from error

    async def drain(self) -> None:
        try:
            await self._inner.drain()
        except asyncssh.Error as error:
            raise _lost(error) from error

    def write_eof(self) -> None:
        self._inner.write_eof()

    def close(self) -> None:
        self._inner.close()

    def is_closing(self) -> bool:
        return self._inner.is_closing()

    async def wait_closed(self) -> None:
        await self._inner.wait_closed()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._inner.get_extra_info(name, default)


# --------------------------------------------------------------- connecting


def connect_options(host: HostSpec, timeout: float) -> dict[str, Any]:
    """asyncssh.connect arguments. What the inventory leaves out is left to
    asyncssh, which takes it from ~/.ssh/config and then its defaults (user,
    port, IdentityFile, ssh-agent, UserKnownHostsFile)."""
    options: dict[str, Any] = {"connect_timeout": timeout}
    if host.port != 22:
        options["port"] = host.port
    if host.user:
        options["username"] = host.user
    if host.identity:
        options["client_keys"] = list(host.identity)  # ssh-agent keys are still offered
    if host.insecure_no_host_key_check:
        options["known_hosts"] = None
    elif host.known_hosts:
        options["known_hosts"] = list(host.known_hosts)
    ciphers = cipher_preference()
    if ciphers:
        options["encryption_algs"] = ciphers
    return options


#: AES-GCM before asyncssh's default ChaCha20-Poly1305 where the CPU has AES
#: instructions: this process encrypts everything it sends, and asyncssh's
#: ChaCha20-Poly1305 took 2.3 times the CPU of AES-128-GCM for the same bytes
#: here (4.5 s against 1.9 s for 512 MiB; docs/bench-delivery.md). Both are
#: OpenSSH's own AEAD ciphers; the server still picks from the full list.
AES_FIRST = "^aes128-gcm@openssh.com,aes256-gcm@openssh.com"


@functools.lru_cache(maxsize=1)
def cipher_preference() -> str:
    """AES_FIRST, or '' (asyncssh's order) without AES instructions or when
    ~/.ssh/config chooses the ciphers itself (a Ciphers line)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""
    if not re.search(r"^(flags|Features)\s*:.*\baes\b", flags, re.MULTILINE):
        return ""
    try:
        config = Path("~/.ssh/config").expanduser().read_text(errors="replace")
    except OSError:
        config = ""
    if re.search(r"^\s*ciphers\b", config, re.IGNORECASE | re.MULTILINE):
        return ""
    return AES_FIRST


def _check_files(host: HostSpec) -> None:
    for key, paths in (("identity", host.identity), ("known_hosts", host.known_hosts)):
        for path in paths:
            if not os.path.isfile(path):
                raise TransportError(
                    f"host {host.name} (inventory line {host.line}): {key} file {path} does not exist"
                )


def known_hosts_in_use(host: HostSpec, options: dict[str, Any]) -> list[str] | None:
    """The known_hosts files asyncssh will check this host's key against, as
    its own option parsing decides (the inventory, else ~/.ssh/config's
    UserKnownHostsFile and GlobalKnownHostsFile, else ~/.ssh/known_hosts);
    None when it will check nothing."""
    settings = {key: options[key] for key in ("port", "username", "known_hosts") if key in options}
    parsed = asyncssh.SSHClientConnectionOptions(config=(), host=host.address, **settings)
    known: Any = parsed.known_hosts  # here: None, or file names from the inventory or the config
    if known is None:
        return None
    names = [known] if isinstance(known, str) else list(known)
    files = [os.path.expanduser(str(name)) for name in names]
    return files or [os.path.expanduser("~/.ssh/known_hosts")]


def _refuse_unchecked(host: HostSpec, where: str) -> None:
    raise TransportError(
        f"{where}: ~/.ssh/config says UserKnownHostsFile none for it, which turns host key checking "
        "off: anyone on the network path could pose as the host and read prompts and outputs. "
        "Remove that line (or give known_hosts: in the host entry); to connect without checking "
        f"anyway, say insecure_no_host_key_check: true for {host.name} in the inventory"
    )


async def _connect(host: HostSpec, timeout: float, entry: PooledConnection) -> asyncssh.SSHClientConnection:
    """One SSH connection, with every way it can fail said in a sentence."""
    _check_files(host)
    where = f"{host.name} ({host.where})"
    if host.insecure_no_host_key_check:
        log.warning(
            "INSECURE: host key checking is OFF for host %s (insecure_no_host_key_check: true): "
            "anyone on the network path can impersonate it and see prompts and outputs",
            where,
        )
    options = connect_options(host, timeout)
    try:
        known_hosts = known_hosts_in_use(host, options)
    except (ValueError, OSError, asyncssh.Error) as error:
        raise TransportError(f"{where}: cannot read the SSH settings for it: {error}") from None
    if known_hosts is None and not host.insecure_no_host_key_check:
        _refuse_unchecked(host, where)
    try:
        connecting = asyncssh.connect(host.address, client_factory=lambda: _Client(entry), **options)
        return await asyncio.wait_for(connecting, timeout)
    except asyncssh.HostKeyNotVerifiable as error:
        raise TransportError(
            f"{where}: host key verification failed ({error.reason}); its key is missing from or "
            f"does not match {', '.join(known_hosts or ())}. Check the host's key fingerprint out of band "
            "and add it there (or set known_hosts: in the host entry); a changed key can mean "
            "someone is impersonating the host"
        ) from None
    except asyncssh.PermissionDenied as error:
        tried = f"identity {', '.join(host.identity)} and " if host.identity else ""
        raise TransportError(
            f"{where}: SSH authentication failed ({error.reason}); tried {tried}ssh-agent and the "
            f"default keys{' as user ' + host.user if host.user else ''}"
        ) from None
    except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as error:
        raise TransportError(
            f"{where}: cannot use the identity key ({error}); an encrypted key belongs in ssh-agent "
            "(ssh-add KEY), not in identity:"
        ) from None
    except asyncssh.ConnectionLost as error:  # dropped before it said anything
        raise HostUnreachable(f"{where}: SSH connection failed: {error.reason}") from None
    except asyncssh.Error as error:
        raise TransportError(f"{where}: SSH connection failed: {error.reason}") from None
    except (asyncio.TimeoutError, TimeoutError):  # before OSError: builtin TimeoutError is one
        raise HostUnreachable(f"{where}: no SSH answer within {timeout:g}s (timeouts.connect)") from None
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise HostUnreachable(f"{where}: cannot reach the SSH server: {reason}") from None


class _Client(asyncssh.SSHClient):
    def __init__(self, entry: PooledConnection) -> None:
        self.entry = entry

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.entry.closing:
            self.entry.lost = str(exc) if exc else "closed by the host"


@dataclass(eq=False, slots=True)
class PooledConnection:
    """One shared connection: its connect task and how many stages use it."""

    task: asyncio.Task[asyncssh.SSHClientConnection] | None = None
    users: int = 0
    lost: str = ""
    closing: bool = False


def _pool_key(host: HostSpec) -> tuple[Any, ...]:
    return (
        host.name,
        host.address,
        host.port,
        host.user,
        host.identity,
        host.known_hosts,
        host.insecure_no_host_key_check,
    )


class ConnectionPool:
    """Connections by host, shared by the stages on it; closed with the last."""

    def __init__(self) -> None:
        self.entries: dict[tuple[Any, ...], PooledConnection] = {}

    async def acquire(
        self, host: HostSpec, timeout: float
    ) -> tuple[PooledConnection, asyncssh.SSHClientConnection]:
        key = _pool_key(host)
        entry = self.entries.get(key)
        if entry is None or entry.lost:
            entry = PooledConnection()
            entry.task = asyncio.ensure_future(_connect(host, timeout, entry))
            self.entries[key] = entry
        entry.users += 1
        assert entry.task is not None
        try:
            # Shielded: one stage giving up must not cancel the others' connect.
            connection = await asyncio.shield(entry.task)
        except BaseException:
            await self.release(host, entry)
            raise
        return entry, connection

    async def release(self, host: HostSpec, entry: PooledConnection) -> None:
        entry.users -= 1
        if entry.users > 0:
            return
        key = _pool_key(host)
        if self.entries.get(key) is entry:
            del self.entries[key]
        entry.closing = True
        task = entry.task
        if task is None:
            return
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return
        if task.cancelled() or task.exception() is not None:
            return
        connection = task.result()
        connection.close()
        with contextlib.suppress(asyncio.TimeoutError, asyncssh.Error, OSError):
            await asyncio.wait_for(connection.wait_closed(), 5)


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ConnectionPool] = weakref.WeakKeyDictionary()


def connection_pool() -> ConnectionPool:
    """The pool of the running event loop (connections cannot cross loops)."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = ConnectionPool()
    return pool
