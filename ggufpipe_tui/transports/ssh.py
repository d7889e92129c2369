"""The SSH transport: an agent on a GPU host, reached with nothing but SSH.

Every channel is an exec session, so a host whose sshd forbids TCP and
stream-local forwarding still works:

* control: ``<agent> [--cache-dir DIR]`` on the stdio of one exec session (or,
  for an agent started by hand with ``--listen``, ``<agent> bridge ADDR``);
* data: a second exec session on the same connection running
  ``<agent> bridge unix:PATH`` to the agent's data socket (PATH from its Hello).

Stages on one host share one SSH connection (a pool per event loop, closed
when its last stage closes). The agent ends when its stdin reaches EOF, which
is what sshd delivers when the channel or the connection goes away, even if
this process is killed with SIGKILL.

Host keys are checked against known_hosts unless the inventory says
``insecure_no_host_key_check: true``; ~/.ssh/config and ssh-agent apply as
they do for ``ssh``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import weakref
from dataclasses import dataclass
from typing import Any

import asyncssh

from ggufpipe_agent.protocol import Hello
from ggufpipe_tui.core.inventory import HostSpec
from ggufpipe_tui.transports.link import AgentLink, LogLine, TransportError

log = logging.getLogger("ggufpipe.ssh")
# asyncssh logs every channel open and close at INFO; under -v those lines
# would bury the agents' own logs. A level set by the user is kept.
if logging.getLogger("asyncssh").level == logging.NOTSET:
    logging.getLogger("asyncssh").setLevel(logging.WARNING)

INSTALL_HINT = (
    "install ggufpipe there (python3 -m venv ~/venvs/ggufpipe && ~/venvs/ggufpipe/bin/pip install "
    "ggufpipe) and, when ggufpipe-agent is not on the login PATH, give its full path in the host "
    "entry (agent: ~/venvs/ggufpipe/bin/ggufpipe-agent); see 'Preparing a GPU host' in docs/ssh.md"
)
MISSING_MARKERS = ("command not found", "No such file or directory", "No module named")
SETTLE_SECONDS = 2.0


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
    return options


def _check_files(host: HostSpec) -> None:
    for key, paths in (("identity", host.identity), ("known_hosts", host.known_hosts)):
        for path in paths:
            if not os.path.isfile(path):
                raise TransportError(
                    f"host {host.name} (inventory line {host.line}): {key} file {path} does not exist"
                )


def _known_hosts_name(host: HostSpec) -> str:
    return ", ".join(host.known_hosts) if host.known_hosts else "~/.ssh/known_hosts"


async def _connect(host: HostSpec, timeout: float, entry: _Entry) -> asyncssh.SSHClientConnection:
    """One SSH connection, with every way it can fail said in a sentence."""
    _check_files(host)
    where = f"{host.name} ({host.where})"
    if host.insecure_no_host_key_check:
        log.warning(
            "INSECURE: host key checking is OFF for host %s (insecure_no_host_key_check: true): "
            "anyone on the network path can impersonate it and see prompts and outputs",
            where,
        )
    try:
        connecting = asyncssh.connect(
            host.address, client_factory=lambda: _Client(entry), **connect_options(host, timeout)
        )
        return await asyncio.wait_for(connecting, timeout)
    except asyncssh.HostKeyNotVerifiable as error:
        raise TransportError(
            f"{where}: host key verification failed ({error.reason}); its key is missing from or "
            f"does not match {_known_hosts_name(host)}. Check the host's key fingerprint out of band "
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
    except asyncssh.Error as error:
        raise TransportError(f"{where}: SSH connection failed: {error.reason}") from None
    except (asyncio.TimeoutError, TimeoutError):  # before OSError: builtin TimeoutError is one
        raise TransportError(f"{where}: no SSH answer within {timeout:g}s (timeouts.connect)") from None
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise TransportError(f"{where}: cannot reach the SSH server: {reason}") from None


class _Client(asyncssh.SSHClient):
    def __init__(self, entry: _Entry) -> None:
        self.entry = entry

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.entry.closing:
            self.entry.lost = str(exc) if exc else "closed by the host"


@dataclass(eq=False, slots=True)
class _Entry:
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
        self.entries: dict[tuple[Any, ...], _Entry] = {}

    async def acquire(self, host: HostSpec, timeout: float) -> tuple[_Entry, asyncssh.SSHClientConnection]:
        key = _pool_key(host)
        entry = self.entries.get(key)
        if entry is None or entry.lost:
            entry = _Entry()
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

    async def release(self, host: HostSpec, entry: _Entry) -> None:
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


# -------------------------------------------------------------------- agent


def _shell_path(path: str) -> str:
    """A quoted path whose leading ~/ the remote shell still expands."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


class SshAgent(AgentLink):
    """An agent on a host reached over SSH (started there on an exec session,
    or started by hand with ``--listen`` and attached through a bridge)."""

    def __init__(self, host: HostSpec, stage: int, on_log: LogLine) -> None:
        super().__init__(host, stage, on_log)
        self.process: asyncssh.SSHClientProcess[bytes] | None = None
        self.bridges: list[asyncssh.SSHClientProcess[bytes]] = []
        self.pool: ConnectionPool | None = None
        self.connection: asyncssh.SSHClientConnection | None = None
        self._entry: _Entry | None = None
        self._control_reader: SshReader | None = None

    def agent_command(self) -> str:
        command = self.host.agent
        if self.host.cache_dir:
            command += f" --cache-dir {_shell_path(self.host.cache_dir)}"
        return command

    def bridge_command(self, endpoint: str) -> str:
        return f"{self.host.agent} bridge {shlex.quote(endpoint)}"

    async def start(self, timeout: float) -> Hello:
        if self.host.insecure_no_host_key_check:
            # Into the stage log, not the stderr tail that error messages quote.
            self.on_log(f"WARNING: host key checking is OFF for {self.host.name} (insecure setting)")
        await self.connect(timeout)
        listen = self.host.listen
        command = self.bridge_command(listen) if listen else self.agent_command()
        self.process = await self._exec(command, timeout)
        self._control_reader = SshReader(self.process.stdout)
        self.reader, self.writer = self._control_reader, SshWriter(self.process.stdin)
        self._spawn(self._pump(self.process, "bridge: " if listen else ""))
        try:
            return await self.handshake(timeout)
        except TransportError as error:
            raise await self._explain(error) from None

    async def connect(self, timeout: float) -> None:
        """This host's shared SSH connection (opened if it is the first stage there)."""
        if self.connection is None:
            self.pool = connection_pool()
            self._entry, self.connection = await self.pool.acquire(self.host, timeout)

    async def _exec(self, command: str, timeout: float) -> asyncssh.SSHClientProcess[bytes]:
        assert self.connection is not None
        try:
            process: asyncssh.SSHClientProcess[bytes] = await asyncio.wait_for(
                self.connection.create_process(command, encoding=None), timeout
            )
        except asyncssh.ChannelOpenError as error:
            raise TransportError(
                f"{self.label}: sshd refused a session ({error.reason}); each stage needs two "
                "sessions on its host's connection (sshd MaxSessions, default 10)"
            ) from None
        except asyncssh.Error as error:
            raise TransportError(f"{self.label}: cannot run '{command}': {error.reason}") from None
        except (asyncio.TimeoutError, TimeoutError):
            raise TransportError(
                f"{self.label}: sshd did not start '{command}' within {timeout:g}s"
            ) from None
        return process

    async def _pump(self, process: asyncssh.SSHClientProcess[bytes], prefix: str) -> None:
        """The host's stderr into the stage log, line by line."""
        stream = SshReader(process.stderr)
        with contextlib.suppress(ConnectionError):
            while True:
                raw = await stream.readline()
                if not raw:
                    return
                self.log_line(prefix + raw.decode("utf-8", errors="replace").rstrip("\n"))

    async def _settle(self, process: asyncssh.SSHClientProcess[bytes]) -> None:
        """Let the exit status and the last stderr lines of a process arrive."""
        with contextlib.suppress(asyncio.TimeoutError, asyncssh.Error, OSError):
            await asyncio.wait_for(process.wait_closed(), SETTLE_SECONDS)
        pending = [task for task in self._tasks if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=0.5)

    async def _explain(self, error: TransportError) -> TransportError:
        """A failed handshake, with the reason when the command itself failed."""
        process = self.process
        assert process is not None
        await self._settle(process)
        spoke = self._control_reader is not None and self._control_reader.received > 0
        if spoke or (not process.is_closing() and process.returncode is None):
            return error  # it spoke, or it still runs: the handshake's own message says it all
        lines = " | ".join(line for line in self.stderr_tail if line.strip())
        said = f": {lines}" if lines else ""
        name, listen = self.host.name, self.host.listen
        if listen:
            return TransportError(
                f"{self.label}: no agent reachable at {listen} on {name}{said}; start one there with: "
                f"{self.host.agent} --listen {listen}"
            )
        status = self._status()
        if process.exit_status == 127 or any(marker in lines for marker in MISSING_MARKERS):
            return TransportError(
                f"{self.label}: the agent command '{self.host.agent}' is not available on {name}"
                f"{status}{said}. To fix: {INSTALL_HINT}"
            )
        return TransportError(f"{self.label}: the agent exited before its Hello{status}{said}")

    def _status(self) -> str:
        process = self.process
        if process is None:
            return ""
        signal = process.exit_signal
        if signal is not None:
            return f" (killed by signal {signal[0]})"
        if process.exit_status is not None:
            return f" (exit status {process.exit_status})"
        return ""

    async def _connect_data(self, endpoint: str) -> tuple[Any, Any]:
        return await self.open_bridge(endpoint, 60.0)

    async def open_bridge(self, endpoint: str, timeout: float) -> tuple[SshReader, SshWriter]:
        """A byte stream to ``endpoint`` (a socket on the host) through
        ``<agent> bridge`` on a new exec session: no forwarding needed."""
        process = await self._exec(self.bridge_command(endpoint), timeout)
        self.bridges.append(process)
        self._spawn(self._pump(process, "data bridge: "))
        return SshReader(process.stdout), SshWriter(process.stdin)

    def alive(self) -> bool:
        process = self.process
        if process is None or process.is_closing() or process.returncode is not None:
            return False
        return not (self._entry is not None and self._entry.lost)

    def exit_detail(self) -> str:
        lost = self._entry.lost if self._entry is not None else ""
        connection = f" (SSH connection to {self.host.where} lost: {lost})" if lost else ""
        return self._status() + connection + self._tail()

    def gone_reason(self) -> str:
        """A lost connection is not an agent that exited: sshd reported no exit
        for it, and its last stderr line predates the loss."""
        lost = self._entry.lost if self._entry is not None else ""
        if lost and not self._status():
            return f"the SSH connection was lost ({lost})"
        return super().gone_reason()

    async def _kill_by_pid(self, timeout: float) -> None:
        """SIGKILL the agent by the pid of its Hello, from a new exec session
        on the same connection. Only a process whose environment holds this
        connection's SSH_CONNECTION is killed: one this connection started,
        seen in the same pid namespace (an agent: command that enters a
        container reports a pid that means another process out here). A
        hand-started agent (listen:) is never ours to end."""
        process, connection, hello = self.process, self.connection, self.hello
        if self.host.listen or hello is None or connection is None or (self._entry and self._entry.lost):
            return
        if process is None or process.returncode is not None:
            return
        pid = int(hello.pid)
        command = (
            f"tr '\\0' '\\n' < /proc/{pid}/environ 2>/dev/null | "
            f'grep -qxF "SSH_CONNECTION=$SSH_CONNECTION" && kill -KILL {pid}'
        )
        try:
            done = await asyncio.wait_for(connection.run(command, check=False), timeout)
        except (asyncio.TimeoutError, asyncssh.Error, OSError) as error:
            self.on_log(f"teardown: could not kill the agent (pid {pid}): {error}")
            return
        if done.exit_status == 0:
            self.on_log(f"teardown: the agent (pid {pid}) did not end on EOF or signals; killed it")

    async def close(self, grace: float) -> None:
        """End the agent: EOF on its stdin is the request to exit, then TERM
        and KILL signal requests, then ``kill -KILL`` of its pid on an exec
        session; then the channel closes, and the last stage on a host closes
        the connection.

        The kill by pid is for an agent that cannot read its EOF (stopped,
        or stuck): sshd refuses signal requests on root logins ("session
        signalling requires privilege separation", OpenSSH 9.2), and neither
        closing the channel nor the connection signals a session's command,
        so a SIGSTOPped agent would outlive the run with its data bridge."""
        for bridge in self.bridges:
            bridge.close()
        process = self.process
        if process is not None:
            with contextlib.suppress(asyncssh.Error, OSError):
                process.stdin.write_eof()
            # Not process.is_closing(): that is True as soon as our EOF is sent.
            # The channel is closed once sshd has reported the command's exit.
            for signal, wait in ((None, grace), ("TERM", min(grace, 1.0)), ("KILL", min(grace, 1.0))):
                if signal is not None:
                    with contextlib.suppress(asyncssh.Error, OSError):
                        process.send_signal(signal)
                if signal == "KILL":
                    await self._kill_by_pid(max(grace, 1.0))
                try:
                    await asyncio.wait_for(process.wait_closed(), wait)
                    break
                except (asyncio.TimeoutError, asyncssh.Error, OSError):
                    continue
            process.close()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 1.0)
        entry, self._entry, self.connection = self._entry, None, None
        if self.pool is not None and entry is not None:
            await self.pool.release(self.host, entry)
