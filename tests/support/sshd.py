"""A real OpenSSH server on loopback for the SSH transport tests.

Temporary host and user keys, an authorized_keys for the current user, a
known_hosts file that trusts the host key, and forwarding switched OFF
(``DisableForwarding yes``): the orchestrator must work on a locked-down host,
so every channel it opens has to be an exec session. A second server
(``sshd_forwarding``) allows local forwarding (no remote), where the
orchestrator reaches the agents' data sockets without a bridge process.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def keygen(path: Path, comment: str) -> str:
    """A new ed25519 key pair at ``path``; returns the public key line."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )
    return path.with_suffix(".pub").read_text().strip()


def sshd_missing() -> str:
    """Why the server cannot run here ('' when it can)."""
    if not os.path.exists(SSHD):
        return f"{SSHD} is missing (apt-get install -y openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is missing (apt-get install -y openssh-client)"
    return ""


class Sshd:
    """One sshd process; ``start()`` returns once it answers with its banner."""

    def __init__(
        self, base: Path, forwarding: bool = False, extra_users: tuple[str, ...] = (), max_sessions: int = 10
    ) -> None:
        self.base = base
        self.forwarding = forwarding  # stream-local (Unix socket) forwarding allowed
        self.port = free_port()
        self.user = getpass.getuser()
        # Other accounts that may log in, each with the client key in its own
        # ~/.ssh/authorized_keys (sshd reads that file as the user).
        self.extra_users = extra_users
        self.max_sessions = max_sessions  # sessions per connection (sshd's default: 10)
        self.host_key = base / "ssh_host_ed25519_key"
        self.client_key = base / "client_ed25519"
        self.stranger_key = base / "stranger_ed25519"  # a key sshd does not accept
        self.known_hosts = base / "known_hosts"
        self.authorized_keys = base / "authorized_keys"
        self.config = base / "sshd_config"
        self.log = base / "sshd.log"
        self.process: subprocess.Popen[bytes] | None = None

    def login(self, user: str) -> dict[str, object]:
        """How an inventory host entry reaches this server as ``user``."""
        return {
            "address": "127.0.0.1",
            "port": self.port,
            "user": user,
            "identity": str(self.client_key),
            "known_hosts": str(self.known_hosts),
        }

    def host_line(self, key_line: str) -> str:
        """A known_hosts line for this server's address and port."""
        kind, blob = key_line.split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {blob}\n"

    def start(self) -> Sshd:
        self.base.mkdir(parents=True, exist_ok=True)
        host_public = keygen(self.host_key, "test-host")
        self.authorized_keys.write_text(keygen(self.client_key, "test-client") + "\n")
        keygen(self.stranger_key, "stranger")
        self.known_hosts.write_text(self.host_line(host_public))
        self.config.write_text(
            "\n".join(
                [
                    f"ListenAddress 127.0.0.1:{self.port}",
                    f"HostKey {self.host_key}",
                    f"AuthorizedKeysFile {self.authorized_keys}"
                    + (" .ssh/authorized_keys" if self.extra_users else ""),
                    f"AllowUsers {' '.join((self.user, *self.extra_users))}",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PidFile none",
                    "PrintMotd no",
                    "LogLevel VERBOSE",
                    f"MaxSessions {self.max_sessions}",
                    # Locked down: no port, socket, X11 or agent forwarding, no tunnels.
                    # The forwarding server allows local forwarding: OpenSSH checks
                    # AllowTcpForwarding for sockets too (the "local" permission set).
                    f"AllowTcpForwarding {'local' if self.forwarding else 'no'}",
                    f"AllowStreamLocalForwarding {'local' if self.forwarding else 'no'}",
                    "AllowAgentForwarding no",
                    "X11Forwarding no",
                    "PermitTunnel no",
                    f"DisableForwarding {'no' if self.forwarding else 'yes'}",
                    "",
                ]
            )
        )
        if os.geteuid() == 0 and not PRIVSEP_DIR.is_dir():
            PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        check = subprocess.run([SSHD, "-t", "-f", str(self.config)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"sshd rejects its test config: {check.stderr.strip()}")
        self.process = subprocess.Popen([SSHD, "-D", "-f", str(self.config), "-E", str(self.log)])
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    if sock.recv(64).startswith(b"SSH-"):
                        return self
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sshd did not start: {self.log_text()[-2000:]}")
            time.sleep(0.05)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def accepted_logins(self) -> int:
        return self.log_text().count("Accepted publickey for")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def session_agents(self) -> dict[int, str]:
        """Live agent and bridge processes running in sessions of this server,
        with their command lines (a login shell about to exec one counts too).

        Read from /proc rather than ps (whose args column is cut to $COLUMNS)
        and told apart by SSH_CONNECTION, which sshd sets in every session and
        which names our port: agents of other tests on this machine, or ones
        a test starts by hand, do not count."""
        found = {}
        port = str(self.port).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                command = (entry / "cmdline").read_bytes()
                if b"ggufpipe_agent" not in command and b"ggufpipe-agent" not in command:
                    continue
                state = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
                environ = (entry / "environ").read_bytes()
            except (OSError, IndexError):
                continue
            if state == b"Z":
                continue
            for variable in environ.split(b"\0"):
                if variable.startswith(b"SSH_CONNECTION=") and variable.split()[-1] == port:
                    found[int(entry.name)] = command.replace(b"\0", b" ").decode(errors="replace").strip()
        return found


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    """A real sshd for the test module. Missing OpenSSH is an error, not a
    skip: scripts/test installs it, and a skipped SSH suite proves nothing."""
    missing = sshd_missing()
    if missing:
        raise RuntimeError(f"the SSH tests need OpenSSH: {missing}")
    server = Sshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sshd_forwarding(tmp_path_factory: pytest.TempPathFactory):
    """A real sshd that allows local (TCP and stream-local) forwarding."""
    missing = sshd_missing()
    if missing:
        raise RuntimeError(f"the SSH tests need OpenSSH: {missing}")
    server = Sshd(tmp_path_factory.mktemp("sshd-forwarding"), forwarding=True).start()
    yield server
    server.stop()


@pytest.fixture
def none_left(sshd: Sshd):
    """Fails the test if an agent or bridge it started through sshd outlives it."""
    from tests.support.ssh_hosts import wait_no_session_agents

    yield
    left = wait_no_session_agents(sshd, 10)
    assert not left, f"agent or bridge processes left on the host: {left}"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One stage-file cache for the module: the first run writes, later ones reuse."""
    return tmp_path_factory.mktemp("ssh-cache")
