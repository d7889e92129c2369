"""A non-root account on this machine that plays a GPU host holding no model.

Run as root (CI), the fixture creates the account (``useradd``), gives it the
loopback sshd's client key in its own ``~/.ssh/authorized_keys`` and installs
the agent the way a real host gets it: a venv made with the system Python
(``/usr/bin/python3 -m venv``: the test's Python may live in root's home,
which the account cannot read), and ggufpipe with its **declared**
dependencies installed into it by pip from a wheelhouse, with no index:

* the dependencies' wheels are made once per dependency set
  (``pip wheel`` of the project, constrained to the versions the test venv runs,
  with the llama-cpp-python wheel ``scripts/setup`` keeps in ``.wheels/``) and
  kept in ``.wheels/deps-KEY``;
* ggufpipe's own wheel is built from the checkout each session.

The account's venv is made anew whenever the dependency set changes (a stamp in
the venv holds its key), so nothing left by an earlier run can stand in for a
missing install step; ggufpipe itself is reinstalled every session. The agent's
own self-check (``ggufpipe-agent --check``) then has to pass.

Run as another user, that user is the account (already not root) and its own
Python is used.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support.common import REPO

ACCOUNT = "ggufpipe-test"
MARKER = ".ggufpipe-test-account"  # in the home of an account these tests created
SYSTEM_PYTHON = "/usr/bin/python3"
WHEELS = REPO / ".wheels"  # scripts/setup keeps the llama-cpp-python wheel here
STAMP = ".ggufpipe-deps"  # in the account's venv: the key of the dependency set installed
PIP_TIMEOUT = 900


@dataclass(frozen=True)
class HostAccount:
    name: str
    home: Path
    python: str  # the agent's interpreter there
    how: str  # "wheels" (installed from them) or "self" (the tests already run as this non-root user)
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


def _pip(*args: str, cwd: Path = REPO) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=PIP_TIMEOUT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args[:2])} failed: {done.stderr.strip()[-2000:]}")


def _constraints() -> str:
    """The test venv's own versions of everything but ggufpipe."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [
        line
        for line in done.stdout.splitlines()
        if line and " @ " not in line and not line.lower().startswith("ggufpipe")
    ]
    return "\n".join(sorted(lines)) + "\n"


def wheelhouse() -> tuple[Path, Path, str]:
    """The dependencies' wheels (made once per dependency set), this checkout's
    ggufpipe wheel (made now), and the dependency set's key."""
    llama = sorted(WHEELS.glob("llama_cpp_python-*.whl"))
    if not llama:
        raise RuntimeError(
            f"no llama-cpp-python wheel in {WHEELS}: run scripts/setup, which keeps the one it builds"
        )
    constraints = _constraints()
    requirements = (REPO / "pyproject.toml").read_text()
    key = hashlib.sha256(f"{constraints}{requirements}{llama[0].name}".encode()).hexdigest()[:16]
    deps = WHEELS / f"deps-{key}"
    own = Path(tempfile.mkdtemp(prefix="ggufpipe-wheel-"))
    # The project's wheel, then (once) every declared dependency as a wheel at
    # the test venv's version; pip reuses its cache, llama-cpp-python is ours.
    # setuptools builds in the checkout's build/, and a build/lib left from
    # before a module moved would put the old module in the wheel too.
    shutil.rmtree(REPO / "build", ignore_errors=True)
    _pip("wheel", "--no-deps", "-w", str(own), str(REPO))
    if not (deps / "complete").exists():
        for old in WHEELS.glob("deps-*"):
            shutil.rmtree(old, ignore_errors=True)
        partial = Path(tempfile.mkdtemp(prefix="deps-", dir=WHEELS))
        (partial / "constraints.txt").write_text(constraints)
        wheel = next(own.glob("ggufpipe-*.whl"))
        _pip(
            "wheel",
            "-w",
            str(partial),
            "--find-links",
            str(WHEELS),
            "-c",
            str(partial / "constraints.txt"),
            str(wheel),
        )
        for extra in partial.glob("ggufpipe-*.whl"):
            extra.unlink()
        (partial / "complete").touch()
        partial.rename(deps)
    return deps, next(own.glob("ggufpipe-*.whl")), key


def install_agent(
    account: HostAccount, venv: Path, deps: Path, wheel: Path, key: str, skip: str = ""
) -> None:
    """A venv at ``venv`` with ggufpipe and its dependencies from the wheels,
    installed by the account's own pip with no index; ``skip``: a wheel left
    out on purpose (a host that lacks one package)."""
    owner = pwd.getpwnam(account.name)
    stamp = venv / STAMP
    if venv.exists() and (not stamp.exists() or stamp.read_text() != key):
        shutil.rmtree(venv)
    fresh = not venv.exists()
    if fresh:
        account.run(SYSTEM_PYTHON, "-m", "venv", str(venv))
    # The wheels where the account can read them (the checkout may be in a
    # directory only root can, as in CI).
    house = account.home / "wheels"
    shutil.rmtree(house, ignore_errors=True)
    house.mkdir()
    for source in [*deps.glob("*.whl"), wheel, deps / "constraints.txt"]:
        if skip and source.name.lower().startswith(skip.lower().replace("-", "_") + "-"):
            continue
        shutil.copy2(source, house / source.name)
    subprocess.run(["chown", "-R", f"{owner.pw_uid}:{owner.pw_gid}", str(house)], check=True)
    # Only these wheels: no index, and none of this machine's pip settings.
    pip = [
        "env",
        f"PIP_CONFIG_FILE={os.devnull}",
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "--disable-pip-version-check",
        "-q",
        "install",
        "--no-index",
        "--find-links",
        str(house),
    ]
    target = str(house / wheel.name)
    if fresh and skip:
        names = [str(w) for w in house.glob("*.whl")]
        done = account.run(*pip, "--no-deps", *names, check=False, timeout=PIP_TIMEOUT)
    elif fresh:
        done = account.run(
            *pip, "-c", str(house / "constraints.txt"), target, check=False, timeout=PIP_TIMEOUT
        )
    else:
        done = account.run(*pip, "--force-reinstall", "--no-deps", target, check=False, timeout=PIP_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"installing ggufpipe into {venv} failed: {done.stderr.strip()[-2000:]}")
    if fresh and not skip:
        stamp.write_text(key)
    shutil.rmtree(house, ignore_errors=True)
    subprocess.run(["chown", "-R", f"{owner.pw_uid}:{owner.pw_gid}", str(venv)], check=True)


def make_account(client_public_key: str) -> HostAccount:
    if os.geteuid() != 0:  # the sshd's own authorized_keys already lets this user in
        return HostAccount(getpass.getuser(), Path.home(), sys.executable, "self", created=False)
    try:
        entry = pwd.getpwnam(ACCOUNT)
        created = (Path(entry.pw_dir) / MARKER).exists()
        if not created:
            raise RuntimeError(
                f"an account {ACCOUNT} exists that these tests did not create; not touching it"
            )
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
    account = HostAccount(ACCOUNT, home, str(venv / "bin" / "python"), "wheels", created)
    deps, wheel, key = wheelhouse()
    try:
        install_agent(account, venv, deps, wheel, key)
    finally:
        shutil.rmtree(wheel.parent, ignore_errors=True)
    check = account.run(account.python, "-m", "ggufpipe_agent", "--check", check=False)
    if check.returncode != 0:
        raise RuntimeError(f"the account's agent cannot run: {check.stderr.strip()}")
    return account


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
