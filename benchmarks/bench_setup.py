"""Agent set-up benchmark: how long a bare host takes to get its agent.

    .venv/bin/python benchmarks/bench_setup.py [--repeats 3] [--build] [--no-write]

Run as root: a brand-new account (only SSH and the system's python3) on a
loopback sshd (tests/support/sshd.py) plays the host. Each repeat, into a
fresh agents folder, interleaved:

* **pushed**: ``ggufpipe-tui setup INVENTORY`` (no ``agent:``): the wheels
  sent over SSH, a venv made and installed from them there with no index,
  the agent's ``--check``;
* **by hand, the floor**: on the host, with the same wheels already in a
  folder there, ``python3 -m venv`` and ``pip install --no-index`` of them
  (what a person does after copying the wheels; no transfer, no check);
* **already there**: ``ggufpipe-tui setup`` again (the probe finds it ready).

``--build``: also once, **built there**: ``install: build`` with the host's
pip on its index (PyPI here), llama-cpp-python compiled on the host (minutes).
Medians; ratios against the floor. Results go to docs/bench-setup.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ggufpipe_tui.provision import wheels  # noqa: E402
from tests.support import hostaccount  # noqa: E402
from tests.support.sshd import Sshd  # noqa: E402

ACCOUNT = "ggufpipe-bench"


def timed_setup(
    server: Sshd, account: hostaccount.HostAccount, folder: Path, **entry: object
) -> tuple[float, str]:
    began = time.monotonic()
    done = hostaccount.run_setup(server, account, folder, **entry)
    seconds = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"setup failed: {done.stderr[-2000:]}")
    return seconds, json.loads(done.stdout)["hosts"][0]["how"]


def by_hand(account: hostaccount.HostAccount, house: wheels.Wheelhouse, target: Path) -> float:
    """venv + pip install --no-index of the wheels, already on the host."""
    folder = account.home / "hand-wheels"
    if not folder.exists():
        folder.mkdir()
        for path in house.files(push=True):
            shutil.copy2(path, folder / path.name)
        subprocess.run(["chown", "-R", f"{account.name}:{account.name}", str(folder)], check=True)
    began = time.monotonic()
    account.run("/usr/bin/python3", "-m", "venv", str(target), timeout=600)
    pip = ["env", f"PIP_CONFIG_FILE={os.devnull}", f"{target}/bin/python", "-m", "pip", "-q", "install"]
    account.run(
        *pip,
        "--no-index",
        "--find-links",
        str(folder),
        "-c",
        str(folder / "constraints.txt"),
        str(folder / house.own.name),
        timeout=900,
    )
    return time.monotonic() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build", action="store_true", help="also once: built there, from the host's index")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ as it is")
    options = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the benchmark makes (and removes) an account of its own")
    base = Path(tempfile.mkdtemp(prefix="bench-setup-"))
    server = Sshd(base / "sshd", extra_users=(ACCOUNT,)).start()
    account = hostaccount.create_account(ACCOUNT, server.client_key.with_suffix(".pub").read_text().strip())
    house = wheels.wheelhouse()
    size = sum(path.stat().st_size for path in house.files(push=True))
    rows: dict[str, list[float]] = {"pushed": [], "hand": [], "again": []}
    built = None
    try:
        for repeat in range(options.repeats):
            agents = account.home / f"agents-{repeat}"
            seconds, how = timed_setup(server, account, base / f"push-{repeat}", agents_dir=str(agents))
            assert how == "pushed", how
            rows["pushed"].append(seconds)
            rows["hand"].append(by_hand(account, house, account.home / f"hand-{repeat}"))
            seconds, how = timed_setup(server, account, base / f"again-{repeat}", agents_dir=str(agents))
            assert how == "ready", how
            rows["again"].append(seconds)
            print(
                f"repeat {repeat + 1}: pushed {rows['pushed'][-1]:.1f} s, by hand {rows['hand'][-1]:.1f} s, "
                f"again {rows['again'][-1]:.2f} s",
                flush=True,
            )
        if options.build:
            built, how = timed_setup(
                server,
                account,
                base / "build",
                agents_dir=str(account.home / "agents-build"),
                install="build",
            )
            assert how == "built there", how
            print(f"built there: {built:.0f} s", flush=True)
    finally:
        server.stop()
        hostaccount.remove_account(account)
        shutil.rmtree(base, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in rows.items()}
    lines = [
        "# Agent set-up: a bare host given its agent over SSH",
        "",
        "Measured by `benchmarks/bench_setup.py` (re-run it to replace this page), on "
        f"{platform.machine()} with {os.cpu_count()} cores, Python {platform.python_version()}, a loopback sshd "
        "and a brand-new account that has only SSH and the system's python3. "
        f"The wheels pushed: {len(house.files(push=True))} files, {size / 2**20:.0f} MiB "
        "(ggufpipe, pip, every dependency at this machine's versions, the llama-cpp-python build that "
        "scripts/setup keeps). Medians of "
        f"{options.repeats} interleaved repeats.",
        "",
        "| way | median | min | max | vs by hand |",
        "|---|---:|---:|---:|---:|",
    ]
    names = {
        "pushed": "**pushed** (`ggufpipe-tui setup`, first time: send, venv, install, `--check`)",
        "hand": "by hand, the floor: `python3 -m venv` + `pip install --no-index` of wheels already there",
        "again": "already set up (`ggufpipe-tui setup` again: connect, probe)",
    }
    for name, label in names.items():
        values = rows[name]
        lines.append(
            f"| {label} | {median[name]:.2f} s | {min(values):.2f} s | {max(values):.2f} s "
            f"| {median[name] / median['hand']:.2f}x |"
        )
    if built is not None:
        lines.append(
            f"| **built there** (`install: build`: pip on the host's index, llama-cpp-python compiled there; once) "
            f"| {built:.0f} s | | | {built / median['hand']:.1f}x |"
        )
    lines += [
        "",
        "A run's own start adds nothing once the agent is there: the agent's command checks for the "
        "set-up agent's ready file in the same exec session that starts it.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not options.no_write:
        (REPO / "docs" / "bench-setup.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
