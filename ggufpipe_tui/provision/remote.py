"""What runs on a host to give it an agent: standard library only.

The orchestrator sends this file's text as ``python3 -c TEXT COMMAND ...``
over the host's SSH connection (nothing of ggufpipe is there yet), so it must
run on any python3: it reports an old one rather than failing to parse.
Two commands, each answering in JSON lines on stdout:

``probe AGENTS NAME CACHE``
    one line: the host's Python and platform, its NVIDIA GPUs, the free disk
    where agents go, whether the agent ``AGENTS/NAME`` is ready, the other
    agents set up there.

``install AGENTS NAME MODE NEED [REDO]``
    sets up ``AGENTS/NAME``: a venv with ggufpipe and its dependencies, from
    the tar stream of wheels on stdin: all of them (MODE ``push``: pip has no
    index) or ggufpipe's own wheel, pip's and the version pins (MODE ``build``:
    pip takes the rest from the host's own index; llama-cpp-python is built
    there, for CUDA when ``nvidia-smi`` shows a GPU). One set-up at a time per
    agent (a lock file); the agent is ready only once ``READY`` is written,
    last, after the agent's own ``--check`` passed: an interrupted set-up
    leaves no ``READY`` and is redone from nothing by the next one. NEED: the
    bytes of free disk the set-up needs; REDO ``1``: set up again an agent
    that is there but cannot run. Lines: ``{"step": ...}`` as each step
    begins, ``{"log": ...}`` for pip's output, ``{"ready": ...}`` at the end,
    ``{"error": ..., "step": ...}`` before exit status 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

READY = "ggufpipe-ready"  # in the agent's venv, written last
MIN_PYTHON = (3, 10)
EXIT_FAILED = 1
#: A portable x86-64 CPU build of llama.cpp (no -march=native: scripts/setup says why).
CPU_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
CUDA_CMAKE_ARGS = "-DGGML_CUDA=on"


def say(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def existing(path):
    """The nearest directory of ``path`` that exists (for its free space)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path):
    try:
        return shutil.disk_usage(existing(path)).free
    except OSError:
        return -1


def gpus():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ["nvidia-smi failed"]
    return [line.strip() for line in out.splitlines() if line.strip()]


def ready(agents, name):
    venv = os.path.join(agents, name)
    return os.path.isfile(os.path.join(venv, READY)) and os.access(
        os.path.join(venv, "bin", "python"), os.X_OK
    )


def probe(agents, name, cache):
    import platform
    import sysconfig

    others = []
    if os.path.isdir(agents):
        others = sorted(entry for entry in os.listdir(agents) if entry != name and ready(agents, entry))
    say(
        python=platform.python_version(),
        executable=sys.executable,
        platform=sysconfig.get_platform(),
        agents=agents,
        cache=cache,
        free=free_bytes(agents),
        gpus=gpus(),
        ready=ready(agents, name),
        others=others,
    )


class Failed(Exception):
    pass


def run_logged(command, env=None):
    """``command``, its output said line by line; the last lines kept for an error."""
    tail: list = []  # noqa: UP006 - the host's Python may be old: plain names only
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        universal_newlines=True,
        errors="replace",
    )
    assert process.stdout is not None
    for line in process.stdout:
        line = line.rstrip()
        if line:
            say(log=line)
            tail = (tail + [line])[-6:]
    if process.wait() != 0:
        raise Failed("; ".join(tail[-3:]) or f"exit status {process.returncode}")


def receive(directory):
    """The wheels of the tar stream on stdin into ``directory`` (flat names only)."""
    import tarfile

    os.makedirs(directory)
    names = []
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as stream:
        for member in stream:
            name = member.name
            if not member.isfile() or "/" in name or name.startswith("."):
                raise Failed(f"unexpected entry {name!r} in the wheels sent")
            source = stream.extractfile(member)
            if source is None:
                raise Failed(f"entry {name!r} of the wheels sent has no data")
            with open(os.path.join(directory, name), "wb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
            names.append(name)
    return names


def install(agents, name, mode, need, redo):
    import fcntl

    step = "lock"
    os.makedirs(agents, exist_ok=True)
    lock = open(os.path.join(agents, name + ".lock"), "w")  # noqa: SIM115 - held to the end
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        say(step="waiting for another set-up of this agent on this host")
        fcntl.flock(lock, fcntl.LOCK_EX)
    venv = os.path.join(agents, name)
    wheels = venv + ".wheels"
    try:
        if redo and ready(agents, name):  # there, but it cannot run
            os.unlink(os.path.join(venv, READY))
        if ready(agents, name):
            sys.stdin.buffer.read()  # what was sent is not needed
            say(ready=venv, already=True)
            return
        step = "clean"
        for leftover in (venv, wheels):  # an interrupted set-up is redone from nothing
            if os.path.lexists(leftover):
                shutil.rmtree(leftover)
        free = free_bytes(agents)
        if 0 <= free < need:
            raise Failed(
                f"not enough free disk at {agents}: {free >> 20} MiB free, "
                f"the set-up needs about {need >> 20} MiB"
            )
        step = "receive"
        say(step="receiving the wheels")
        names = receive(wheels)
        pip_wheel = [n for n in names if n.startswith("pip-") and n.endswith(".whl")]
        own = [n for n in names if n.startswith("ggufpipe-") and n.endswith(".whl")]
        if not pip_wheel or not own or "constraints.txt" not in names:
            raise Failed("the wheels sent lack pip's, ggufpipe's or the version pins")
        step = "venv"
        say(step="making the venv")
        run_logged([sys.executable, "-m", "venv", "--without-pip", venv])
        python = os.path.join(venv, "bin", "python")
        local = os.path.join(wheels, pip_wheel[0])
        env = dict(os.environ)
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        env["PIP_NO_INPUT"] = "1"
        env.pop("PYTHONPATH", None)
        quiet = dict(env, PIP_CONFIG_FILE=os.devnull)
        run_logged([python, os.path.join(local, "pip"), "install", "-q", "--no-index", local], env=quiet)
        pins = os.path.join(wheels, "constraints.txt")
        target = os.path.join(wheels, own[0])
        if mode == "push":
            step = "install"
            say(step="installing the wheels sent (no index)")
            command = [
                python,
                "-m",
                "pip",
                "install",
                "--no-index",
                "--find-links",
                wheels,
                "-c",
                pins,
                target,
            ]
            run_logged(command, env=quiet)
        else:
            step = "build"
            cuda = bool(gpus())
            import platform

            portable = CPU_CMAKE_ARGS if platform.machine() in ("x86_64", "AMD64") else ""
            env["CMAKE_ARGS"] = env.get("CMAKE_ARGS") or (CUDA_CMAKE_ARGS if cuda else portable)
            say(
                step="installing from this host's index; llama-cpp-python is built here (%s): minutes"
                % ("CUDA" if cuda else "CPU")
            )
            run_logged([python, "-m", "pip", "install", "-v", "-c", pins, target], env=env)
        step = "check"
        say(step="checking the agent")
        run_logged([python, "-m", "ggufpipe_agent", "--check"], env=env)
        with open(os.path.join(venv, READY), "w") as stamp:
            json.dump({"mode": mode, "python": sys.version.split()[0]}, stamp)
        shutil.rmtree(wheels, ignore_errors=True)
        say(ready=venv, already=False)
    except (Failed, OSError, subprocess.SubprocessError) as error:
        text = str(error) if isinstance(error, Failed) else f"{type(error).__name__}: {error}"
        shutil.rmtree(wheels, ignore_errors=True)
        say(error=text, step=step)
        sys.exit(EXIT_FAILED)
    finally:
        lock.close()


def main(argv):
    if sys.version_info[:2] < MIN_PYTHON:
        import platform

        say(python=platform.python_version(), executable=sys.executable, too_old=True)
        return
    command, rest = argv[0], argv[1:]
    if command == "probe":
        probe(*rest)
    elif command == "install":
        install(rest[0], rest[1], rest[2], int(rest[3]), rest[4:] == ["1"])
    else:
        say(error=f"unknown command {command!r}", step="start")
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main(sys.argv[1:])
