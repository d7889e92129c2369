"""A non-root account on this machine that plays a GPU host holding no model.

Run as root (CI), the fixture creates the account (``useradd``), gives it the
loopback sshd's client key in its own ``~/.ssh/authorized_keys`` and a venv
made with the system Python (``/usr/bin/python3 -m venv``) in its home: the
test's Python may live in root's home, which the account cannot read. The
project's packages reach that venv one of two ways, whichever works here:

* ``pth``: a ``.pth`` file naming the repository and the test venv's
  site-packages, when the account can read and import them (a checkout in a
  world-readable place, such as /work here);
* ``copied``: the packages the agent imports (ggufpipe_agent itself, llama_cpp,
  numpy, msgpack, gguf, ... found by importing them) copied into the account's
  venv, when it cannot (a checkout under /root, as in CI).

Either way the interpreter is the system's and the packages are the very
ones the tests run with (same Python minor version: their compiled parts are
the same ABI). Run as another user, that user is the account (already not
root) and its own Python is used.
"""

from __future__ import annotations

import getpass
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO

ACCOUNT = "ggufpipe-test"
MARKER = ".ggufpipe-test-account"  # in the home of an account these tests created
SYSTEM_PYTHON = "/usr/bin/python3"
#: What an agent imports, from its entry point to a loaded stage.
AGENT_MODULES = (
    "ggufpipe_agent.cli",
    "ggufpipe_agent.runtime",
    "ggufpipe_agent.session",
    "ggufpipe_agent.delivery",
    "ggufpipe_agent.engine",
    "ggufpipe_agent.vocab",
    "ggufpipe_agent.model",
    "ggufpipe_agent.ggml",
    "ggufpipe_agent.identity",
    "llama_cpp",
    "uvloop",
)


@dataclass(frozen=True)
class HostAccount:
    name: str
    home: Path
    python: str  # the agent's interpreter there
    how: str  # "pth", "copied" or "self" (the tests already run as this non-root user)
    created: bool  # this fixture made it (and removes it)

    @property
    def agent(self) -> str:
        return f"{self.python} -m ggufpipe_agent"

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``command`` as the account (directly when the tests already run as it)."""
        prefix = ["runuser", "-u", self.name, "--"] if os.geteuid() == 0 else []
        # From its home, as over SSH: nothing of the test's checkout comes in through the cwd.
        return subprocess.run(
            [*prefix, *command], capture_output=True, text=True, check=check, timeout=120, cwd=self.home
        )

    def can_read(self, path: Path) -> bool:
        return self.run("test", "-r", str(path), check=False).returncode == 0


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _needed_packages() -> list[Path]:
    """The top-level packages and modules (and their bundled .libs) that the
    agent imports from the test venv's site-packages."""
    site = _site_packages()
    script = (
        "import sys, importlib\n"
        f"for name in {AGENT_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "for module in list(sys.modules.values()):\n"
        "    where = getattr(module, '__file__', None)\n"
        "    if where: print(where)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    tops: set[Path] = set()
    for line in done.stdout.splitlines():
        path = Path(line)
        try:
            relative = path.relative_to(site)
        except ValueError:
            continue
        tops.add(site / relative.parts[0])
    for libs in site.glob("*.libs"):  # manylinux wheels' bundled shared libraries (numpy.libs)
        if any(top.name.split(".")[0] == libs.name.split(".")[0] for top in tops):
            tops.add(libs)
    return sorted(top for top in tops if top.name != "__editable___ggufpipe_0_1_0_finder.py")


def _fill_venv(account: HostAccount, site: Path) -> str:
    """Make the project's packages importable in the account's venv."""
    probe = f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(_site_packages())!r}]; import " + ", ".join(
        AGENT_MODULES
    )
    if account.run(account.python, "-c", probe, check=False).returncode == 0:
        (site / "ggufpipe-test.pth").write_text(f"{REPO}\n{_site_packages()}\n")
        return "pth"
    for source in [REPO / "ggufpipe_agent", *_needed_packages()]:
        target = site / source.name
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    return "copied"


def make_account(client_public_key: str) -> HostAccount:
    if os.geteuid() != 0:  # the sshd's own authorized_keys already lets this user in
        return HostAccount(getpass.getuser(), Path.home(), sys.executable, "self", created=False)
    system = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True
    )
    if system.returncode != 0 or tuple(map(int, system.stdout.split())) != sys.version_info[:2]:
        raise RuntimeError(
            f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}: the non-root agent "
            "would not load the test venv's compiled packages"
        )
    try:
        entry = pwd.getpwnam(ACCOUNT)
        created = (Path(entry.pw_dir) / MARKER).exists()
        if not created:
            raise RuntimeError(f"an account {ACCOUNT} exists that these tests did not create; not touching it")
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", ACCOUNT], check=True)
        # useradd leaves the password locked ("!"), which sshd refuses even for
        # keys (without PAM); "*" is no password at all, and not locked.
        subprocess.run(["usermod", "--password", "*", ACCOUNT], check=True)
        entry = pwd.getpwnam(ACCOUNT)
        created = True
    home = Path(entry.pw_dir)
    (home / MARKER).touch()
    _authorize(home, client_public_key, owner=entry)
    venv = home / "venv"
    account = HostAccount(ACCOUNT, home, str(venv / "bin" / "python"), "", created)
    if not venv.exists():
        account.run(SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(venv))
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(account.run(account.python, "-c", where).stdout.strip())
    how = _fill_venv(account, site)
    subprocess.run(["chown", "-R", f"{entry.pw_uid}:{entry.pw_gid}", str(venv)], check=True)
    check = account.run(account.python, "-m", "ggufpipe_agent", "--version", check=False)
    if check.returncode != 0:
        raise RuntimeError(f"the account's agent does not start ({how}): {check.stderr.strip()}")
    return HostAccount(ACCOUNT, home, account.python, how, created)


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
