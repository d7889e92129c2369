"""The SSH transport: an agent on a GPU host, reached with nothing but SSH.

Every channel is an exec session, so a host whose sshd forbids TCP and
stream-local forwarding still works:

* control: ``<agent> [--cache-dir DIR]`` on the stdio of one exec session (or,
  for an agent started by hand with ``--listen``, ``<agent> bridge ADDR``);
* data: a direct-streamlocal channel to the agent's data socket (PATH from
  its Hello) where sshd allows stream-local forwarding (one hop fewer: sshd
  connects to the socket itself); elsewhere a second exec session on the
  same connection running ``<agent> bridge unix:PATH``.

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
import shlex
from typing import Any

import asyncssh

from ggufpipe_agent import UNFIT_MARKER, __version__
from ggufpipe_agent.wire import listen_key
from ggufpipe_agent.wire.endpoints import parse_endpoint
from ggufpipe_agent.wire.protocol import Hello
from ggufpipe_tui.core.inventory import HostSpec
from ggufpipe_tui.provision import hosts as provision
from ggufpipe_tui.provision.shell import output_text, shell_path
from ggufpipe_tui.transports.connection import (
    LISTEN_TRY_MIN,
    AgentConnection,
    AgentNotSetUp,
    ListenRetry,
    LogLine,
    TransportError,
)
from ggufpipe_tui.transports.sshconn import (
    ConnectionPool,
    PooledConnection,
    SshReader,
    SshWriter,
    connection_pool,
)

INSTALL_HINT = (
    "give the agent's full path in the host's agent: (e.g. ~/venvs/ggufpipe/bin/ggufpipe-agent), or leave "
    "agent: out and ggufpipe sets one up there over SSH (docs/ssh.md, 'Getting the agent onto a host')"
)
MISSING_MARKERS = ("command not found", "No such file or directory", "No module named")
SETTLE_SECONDS = 2.0


# -------------------------------------------------------------------- agent


class SshAgent(AgentConnection):
    """An agent on a host reached over SSH (started there on an exec session,
    or started by hand with ``--listen`` and attached through a bridge)."""

    def __init__(self, host: HostSpec, stage: int, on_log: LogLine) -> None:
        super().__init__(host, stage, on_log)
        self.process: asyncssh.SSHClientProcess[bytes] | None = None
        self.bridges: list[asyncssh.SSHClientProcess[bytes]] = []
        self.forwarded: list[SshWriter] = []  # data channels sshd connected for us
        self.data_route = ""  # "stream-local forwarding" or "exec bridge", once open
        self.pool: ConnectionPool | None = None
        self.connection: asyncssh.SSHClientConnection | None = None
        self._entry: PooledConnection | None = None
        self._control_stream: SshReader | None = None
        self._socket_bridges: dict[int, asyncssh.SSHClientProcess[bytes]] = {}  # by id(writer)

    @property
    def agent(self) -> str:
        """The agent's command: the entry's agent:, or the one ggufpipe sets up there."""
        return self.host.agent or provision.managed_agent(self.host)

    def agent_command(self, subcommand: str = "") -> str:
        arguments = f" {subcommand}" if subcommand else ""
        if self.host.cache_dir:
            arguments += f" --cache-dir {shell_path(self.host.cache_dir)}"
        if self.share_process and not subcommand:
            arguments += " --share-process"
        if not self.host.agent and not subcommand:
            # Started only where it is set up; else exit NOT_SET_UP at once.
            return provision.start_command(self.host, arguments)
        return self.agent + arguments

    def bridge_command(self, endpoint: str) -> str:
        return f"{self.agent} bridge {shlex.quote(endpoint)}"

    async def set_up(
        self, progress: provision.Progress, timeout: float, redo: bool = False
    ) -> provision.SetupResult:
        """Give the host this orchestrator's agent (:mod:`ggufpipe_tui.provision.hosts`)."""
        await self.connect(timeout)
        assert self.connection is not None
        self.stderr_tail.clear()  # the failed start's words are answered
        return await provision.set_up_once(self.host, self.connection, progress, self.on_log, redo)

    async def start(self, timeout: float) -> Hello:
        if self.host.insecure_no_host_key_check:
            # Into the stage log, not the stderr tail that error messages quote.
            self.on_log(f"WARNING: host key checking is OFF for {self.host.name} (insecure setting)")
        loop = asyncio.get_running_loop()
        began = loop.time()
        await self.connect(timeout)
        if self.host.listen:
            # The tries share what the SSH connection left of the timeout, so
            # that giving up (and naming each try) comes before the caller's
            # own bound does.
            return await self.attach_listening(max(timeout - (loop.time() - began), LISTEN_TRY_MIN))
        await self._open_control(self.agent_command(), timeout)
        try:
            return await self.handshake(timeout)
        except TransportError as error:
            raise await self._explain(error) from None

    async def _open_control(self, command: str, timeout: float, prefix: str = "") -> None:
        self.process = await self._exec(command, timeout)
        self._control_stream = SshReader(self.process.stdout)
        self._streams(self._control_stream, SshWriter(self.process.stdin))
        self.tasks.spawn(self.pump_stderr(SshReader(self.process.stderr), prefix), "stderr pump")

    async def _open_listening(self, timeout: float) -> None:
        """A bridge to the hand-started agent's socket, on a new exec session."""
        await self._open_control(self.bridge_command(self.host.listen), timeout, "bridge: ")

    async def _listen_try(self, timeout: float) -> Hello:
        await self._open_listening(timeout)
        try:
            await self.authenticate(timeout)
            return await self.handshake(timeout, listening=True)
        except ListenRetry:
            if self._control_stream is not None and self._control_stream.received > 0:
                raise  # the agent spoke (busy, or closed mid-handshake): its words say it all
            raise await self._explain_listening() from None
        except TransportError as error:
            raise await self._explain(error) from None

    async def _explain_listening(self) -> TransportError:
        """A bridge that ended before the agent said anything: it could not
        connect (no agent there: the bridge says why and exits 1), or it did
        and the agent closed the connection (the bridge exits 0)."""
        closed = ListenRetry(
            f"{self.label}: the agent listening on {self.host.listen} on {self.host.name} closed the "
            f"connection before its challenge{self._tail()}",
            "closed before its challenge",
        )
        explained = await self._explain(closed)
        process = self.process
        if explained is not closed and process is not None and process.exit_status == 0:
            return closed
        return explained

    async def _drop_listening(self) -> None:
        """End a failed try's bridge (its stderr pump ends at its EOF)."""
        process, self.process, self._control_stream = self.process, None, None
        if process is None:
            return
        with contextlib.suppress(asyncssh.Error, OSError):
            process.stdin.write_eof()
        process.close()
        with contextlib.suppress(asyncio.TimeoutError, asyncssh.Error, OSError):
            await asyncio.wait_for(process.wait_closed(), SETTLE_SECONDS)

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

    async def read_listen_key(self, timeout: float) -> bytes:
        """The hand-started agent's key file, read with ``cat`` on an exec
        session as the SSH user (the agent's user: the file is 0600)."""
        assert self.connection is not None
        path, name = self.listen_key_path, self.host.name
        try:
            done = await asyncio.wait_for(
                self.connection.run(f"cat -- {shell_path(path)}", check=False, encoding=None), timeout
            )
        except (asyncio.TimeoutError, asyncssh.Error, OSError) as error:
            raise TransportError(
                f"{self.label}: cannot read the listen key {path} on {name} ({error})"
            ) from None
        if done.exit_status != 0:
            said = output_text(done.stderr).strip().splitlines()
            raise TransportError(
                f"{self.label}: cannot read the listen key {path} on {name}"
                f"{': ' + said[-1] if said else ''}; the agent started with --listen {self.host.listen} "
                "prints the path of its key file (give it as listen_key: when it is not the default, "
                "and log in as the user who started it)"
            )
        try:
            return listen_key.parse_key(output_text(done.stdout).encode(), f"{path} on {name}")
        except listen_key.ListenKeyError as error:
            raise TransportError(f"{self.label}: {error}") from None

    async def _settle(self, process: asyncssh.SSHClientProcess[bytes]) -> None:
        """Let the exit status and the last stderr lines of a process arrive."""
        with contextlib.suppress(asyncio.TimeoutError, asyncssh.Error, OSError):
            await asyncio.wait_for(process.wait_closed(), SETTLE_SECONDS)
        await self.tasks.settle(0.5)

    async def _explain(self, error: TransportError) -> TransportError:
        """A failed handshake, with the reason when the command itself failed."""
        process = self.process
        assert process is not None
        await self._settle(process)
        spoke = self._control_stream is not None and self._control_stream.received > 0
        if spoke or (not process.is_closing() and process.returncode is None):
            return error  # it spoke, or it still runs: the handshake's own message says it all
        lines = " | ".join(line for line in self.stderr_tail if line.strip())
        said = f": {lines}" if lines else ""
        name, listen = self.host.name, self.host.listen
        if listen:
            return TransportError(
                f"{self.label}: no agent reachable at {listen} on {name}{said}; start one there with: "
                f"{self.agent} --listen {listen}"
            )
        status = self._status()
        if process.exit_status == provision.NOT_SET_UP and not self.host.agent:
            return AgentNotSetUp(f"{self.label}: no agent set up on {name} for this orchestrator yet")
        unfit = [line for line in self.stderr_tail if UNFIT_MARKER in line]
        if unfit:
            said = unfit[-1].split(UNFIT_MARKER, 1)[1].strip()
            if not self.host.agent:
                return AgentNotSetUp(
                    f"{self.label}: the agent set up on {name} cannot run: {said}", broken=True
                )
            return TransportError(
                f"{self.label}: the agent '{self.agent}' on {name} cannot run: {said}. To fix: "
                f"install ggufpipe=={__version__} with its dependencies in that Python's venv, and check "
                f"with: {self.agent} --check"
            )
        if process.exit_status == 127 or any(marker in lines for marker in MISSING_MARKERS):
            return TransportError(
                f"{self.label}: the agent command '{self.agent}' is not available on {name}"
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
        path, port = parse_endpoint(endpoint)
        if port is None and self.connection is not None:
            try:
                reader, writer = await asyncio.wait_for(self.connection.open_unix_connection(path), 60.0)
            except (asyncssh.ChannelOpenError, asyncio.TimeoutError):
                pass  # sshd forbids stream-local forwarding (or never answered): the bridge works anyway
            else:
                self.data_route = "stream-local forwarding"
                self.forwarded.append(SshWriter(writer))
                return SshReader(reader), self.forwarded[-1]
        self.data_route = "exec bridge"
        return await self.open_bridge(endpoint, 60.0)

    async def open_delivery(self) -> tuple[Any, Any]:
        """A stage file's stream: ``<agent> receive`` on a new exec session
        writes it into the same cache as the agent's (same ``--cache-dir``),
        straight from sshd's pipe: no bridge process, no socket hop, no event
        loop on the host's side (less than half the host's CPU per byte,
        docs/bench-delivery.md). A hand-started agent (listen:) may use
        another cache: it receives on its data socket, as before."""
        if self.host.listen:
            return await super().open_delivery()
        return await self._stream_session(self.agent_command("receive"), 60.0, "receive")

    async def open_bridge(
        self, endpoint: str, timeout: float, what: str = "data bridge"
    ) -> tuple[SshReader, SshWriter]:
        """A byte stream to ``endpoint`` (a socket on the host) through
        ``<agent> bridge`` on a new exec session: no forwarding needed."""
        return await self._stream_session(self.bridge_command(endpoint), timeout, what)

    async def _stream_session(self, command: str, timeout: float, what: str) -> tuple[SshReader, SshWriter]:
        """``command`` on a new exec session as a byte stream; its stderr into
        the stage log as ``what: ...``; closed with the stage."""
        process = await self._exec(command, timeout)
        self.bridges.append(process)
        self.tasks.spawn(self.pump_stderr(SshReader(process.stderr), f"{what}: "), f"{what} stderr pump")
        return SshReader(process.stdout), SshWriter(process.stdin)

    async def open_socket(self, endpoint: str, timeout: float) -> tuple[Any, Any]:
        """Through an exec bridge on this host's connection: a shared process's
        control traffic, which needs no forwarding permission."""
        reader, writer = await self.open_bridge(endpoint, timeout, "share bridge")
        self._socket_bridges[id(writer)] = self.bridges[-1]
        return reader, writer

    async def close_socket(self, writer: Any, grace: float) -> None:
        """The bridge ends at its stdin's EOF (sent by the writer's owner)."""
        bridge = self._socket_bridges.pop(id(writer), None)
        if bridge is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncssh.Error, OSError):
                await asyncio.wait_for(bridge.wait_closed(), grace)
            bridge.close()

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
        for channel in self.forwarded:
            channel.close()
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
        await self.tasks.settle(1.0)
        await self.tasks.close()
        entry, self._entry, self.connection = self._entry, None, None
        if self.pool is not None and entry is not None:
            await self.pool.release(self.host, entry)
