"""A non-root account on this machine that plays a GPU host holding no model.

Run as root (CI), the fixture creates the account (``useradd``) with nothing
in it but the loopback sshd's client key in its own ``~/.ssh/authorized_keys``,
and gives it its agent the way ggufpipe gives any host one: ``ggufpipe-tui
setup`` over SSH on an inventory whose entry names no ``agent:``
(provision/hosts.py: the wheels pushed, pip there with no index, a venv of
the system's python3 under its ``~/.cache/ggufpipe/agents``). The agent's
own self-check (``ggufpipe-agent --check``) then has to pass.

Run as another user, that user is the account (already not root), set up
the same way in its own home.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from ggufpipe_tui.provision import wheels
from tests.support.common import REPO
from tests.support.sshd import Sshd

ACCOUNT = "ggufpipe-test"
MARKER = ".ggufpipe-test-account"  # in the home of an account these tests created
SYSTEM_PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class HostAccount:
    name: str
    home: Path
    python: str  # the agent's interpreter there
    how: str  # "wheels" (an account made for the tests) or "self" (the tests already run as this non-root user)
    created: bool  # this fixture made it (and removes it)

    @property
    def agent(self) -> str:
        return f"{self.python} -m ggufpipe_agent"

    def run(
        self, *command: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """``command`` as the account (directly when the tests already run as it)."""
        prefix = ["runuser", "-u", self.name, "--"] if os.geteuid() == 0 else []
        # From its home, as over SSH: nothing of the test's checkout comes in through the cwd.
        return subprocess.run(
            [*prefix, *command], capture_output=True, text=True, check=check, timeout=timeout, cwd=self.home
        )

    def can_read(self, path: Path) -> bool:
        return self.run("test", "-r", str(path), check=False).returncode == 0


def install_agent(account: HostAccount, venv: Path, house: wheels.Wheelhouse, skip: str) -> None:
    """A venv at ``venv`` with ggufpipe and every dependency but ``skip``
    (a host that lacks one package), by the account's own pip with no index."""
    owner = pwd.getpwnam(account.name)
    shutil.rmtree(venv, ignore_errors=True)
    account.run(SYSTEM_PYTHON, "-m", "venv", str(venv))
    folder = Path(tempfile.mkdtemp(prefix="wheels-", dir=account.home))
    try:
        for source in [*house.deps, house.own]:
            if not source.name.lower().startswith(skip.lower().replace("-", "_") + "-"):
                shutil.copy2(source, folder / source.name)
        subprocess.run(["chown", "-R", f"{owner.pw_uid}:{owner.pw_gid}", str(folder)], check=True)
        pip = ["env", f"PIP_CONFIG_FILE={os.devnull}", str(venv / "bin" / "python"), "-m", "pip"]
        names = [str(wheel) for wheel in folder.glob("*.whl")]
        done = account.run(*pip, "install", "-q", "--no-index", "--no-deps", *names, check=False, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"installing into {venv} failed: {done.stderr.strip()[-2000:]}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def create_account(name: str, public_key: str) -> HostAccount:
    """The account ``name`` with nothing but SSH access (created when run as
    root; else the tests' own user). Its ``python`` is set by :func:`set_up_agent`."""
    if os.geteuid() != 0:  # the sshd's own authorized_keys already lets this user in
        return HostAccount(getpass.getuser(), Path.home(), "", "self", created=False)
    try:
        entry = pwd.getpwnam(name)
        created = (Path(entry.pw_dir) / MARKER).exists()
        if not created:
            raise RuntimeError(f"an account {name} exists that these tests did not create; not touching it")
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True)
        # useradd leaves the password locked ("!"), which sshd refuses even for
        # keys (without PAM); "*" is no password at all, and not locked.
        subprocess.run(["usermod", "--password", "*", name], check=True)
        entry = pwd.getpwnam(name)
        created = True
    home = Path(entry.pw_dir)
    (home / MARKER).touch()
    _authorize(home, public_key, owner=entry)
    return HostAccount(name, home, "", "wheels", created)


def account_entry(server: Sshd, account: HostAccount, **extra: object) -> dict[str, object]:
    """The account as an inventory host (no agent: ggufpipe sets one up)."""
    entry: dict[str, object] = {**server.login(account.name), "threads": 1}
    entry.update(extra)
    return entry


def run_setup(
    server: Sshd, account: HostAccount, folder: Path, *extra: str, **entry: object
) -> subprocess.CompletedProcess[str]:
    """``ggufpipe-tui setup`` for the account alone, as a user runs it."""
    document = {
        "model": {"path": "unused.gguf", "send": True},
        "hosts": {"host": account_entry(server, account, **entry)},
        "stages": [{"host": "host"}],
        "timeouts": {"connect": 30},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "setup.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return subprocess.run(
        [sys.executable, "-m", "ggufpipe_tui.cli", "setup", str(path), "--json", *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=1800,
    )


def set_up_agent(server: Sshd, account: HostAccount, folder: Path) -> HostAccount:
    """The account given its agent by ``ggufpipe-tui setup``; its ``python`` that agent's."""
    done = run_setup(server, account, folder)
    if done.returncode != 0:
        raise RuntimeError(f"ggufpipe-tui setup failed for {account.name}: {done.stderr.strip()[-3000:]}")
    report = json.loads(done.stdout)["hosts"][0]
    python = f"{report['agents_dir']}/{wheels.this_build().name}/bin/python"
    made = dataclasses.replace(account, python=python)
    check = made.run(python, "-m", "ggufpipe_agent", "--check", check=False)
    if check.returncode != 0:
        raise RuntimeError(f"the account's agent cannot run: {check.stderr.strip()}")
    return made


def make_account(server: Sshd, folder: Path) -> HostAccount:
    """The test account, its agent set up by ggufpipe over SSH."""
    account = create_account(ACCOUNT, server.client_key.with_suffix(".pub").read_text().strip())
    return set_up_agent(server, account, folder)


def _authorize(home: Path, public_key: str, owner: pwd.struct_passwd) -> None:
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700, exist_ok=True)
    keys = ssh / "authorized_keys"
    lines = keys.read_text().splitlines() if keys.exists() else []
    if public_key not in lines:
        keys.write_text("\n".join([*lines, public_key]) + "\n")
    keys.chmod(0o600)
    for path in (ssh, keys):
        os.chown(path, owner.pw_uid, owner.pw_gid)


def remove_account(account: HostAccount) -> None:
    """Remove an account these tests created, with its home (venv, caches).
    Its processes are the tests' to have ended (they check none is left)."""
    if account.created:
        subprocess.run(["userdel", "--remove", account.name], check=False, capture_output=True)
