"""The inventory: model, hosts and ordered stages, read from YAML.

Pure: parsing and checking do no I/O beyond reading the file. Every error
names the file, the line and the key, e.g.
``inventory.yaml:7: stages[1].host: 'gpu-c' is not defined under hosts``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.wire.endpoints import parse_endpoint
from ggufpipe_agent.wire.records import sampling_problem

ACTIVATION_DTYPES = ("float32", "float16")
#: How activations move between stages (``data:``, globally or per host):
#: "auto" tries a direct link and falls back to the relay where the probe
#: fails; "direct" insists (a link that cannot be set up fails the start);
#: "relay" sends every object through the orchestrator.
DATA_MODES = ("auto", "direct", "relay")
#: How an SSH host with no agent: gets one (provision/hosts.py).
INSTALL_MODES = ("auto", "push", "build")
#: The agent a hand-started host (listen:) runs when its entry names none.
DEFAULT_AGENT = "ggufpipe-agent"

#: Where a host's stages keep a mixture of experts' routed experts when they
#: offload to a GPU (``experts:``): "auto" on the GPU unless it cannot hold
#: them and the host's RAM can (the planner decides, docs/planning.md); "gpu"
#: always there; "ram" always in host RAM (llama.cpp's --cpu-moe).
EXPERT_MODES = ("auto", "gpu", "ram")

#: Runs in flight at most (``run.parallel``; a stage's slots: the agent takes 256).
MAX_PARALLEL = 64
#: What a follow-up turn keeps of the stages' KV caches (``run.reuse``).
REUSE_MODES = ("cache", "exact")

#: Who feeds each sampled token back to stage 0 (``run.feedback``).
FEEDBACK_MODES = ("ring", "orchestrator")


class InventoryError(GgufpipeError):
    """A malformed inventory; the message names the file, line and key."""


@dataclass(frozen=True, slots=True)
class HostSpec:
    name: str
    line: int
    local: bool = False
    address: str = ""
    port: int = 22
    user: str = ""
    identity: tuple[str, ...] = ()
    known_hosts: tuple[str, ...] = ()
    insecure_no_host_key_check: bool = False
    # The agent's command there. "": on an SSH host, the agent this
    # orchestrator sets up itself (provision/hosts.py); on a hand-started one
    # (listen:), ggufpipe-agent from the login PATH; locally this ggufpipe.
    agent: str = ""
    agents_dir: str = ""  # where set-up agents go there ("": ~/.cache/ggufpipe/agents)
    install: str = "auto"  # INSTALL_MODES: how an agent is set up there
    python: str = "python3"  # the host's Python that sets an agent up
    model_path: str = ""
    listen: str = ""
    listen_key: str = ""  # the hand-started agent's key file on the host ("": its default)
    threads: int = 0
    gpu_layers: int = -1
    experts: str = "auto"  # EXPERT_MODES: a mixture of experts' routed experts on the GPU or in RAM
    cache_dir: str = ""
    memory: int = 0  # bytes of RAM the plan may use there; 0: what the agent reports
    data: str = ""  # DATA_MODES; "" takes the inventory's top-level data: (default "auto")
    link_address: str = ""  # where other hosts reach this one's links (default: its address)
    # The stages placed on this host run in one agent process (one OpenMP
    # team for all; the first stage's agent, the others attached to it).
    share_process: bool = False
    # Named by no stage: recovery moves a lost stage here when its own host
    # does not answer (docs/recovery.md).
    spare: bool = False

    @property
    def where(self) -> str:
        if self.local:
            return "local"
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port != 22 else ""
        return f"{user}{self.address or self.name}{port}"


@dataclass(frozen=True, slots=True)
class StageSpec:
    host: str
    line: int
    layers: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class RunOptions:
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0
    context: int = 2048
    ubatch: int = 512
    activation_dtype: str = "float32"
    chat: bool = True
    ignore_eos: bool = False
    feedback: str = "ring"  # FEEDBACK_MODES
    # What a follow-up keeps of the stages' KV caches (REUSE_MODES): "cache"
    # everything they hold (one llama.cpp context keeping its cache, as
    # llama-server does); "exact" only what a cold run computes alike.
    reuse: str = "cache"
    # Slots: runs in flight at once on the chain, each stage holding each
    # run's KV cache in its own slot (issue 29; the server's --parallel).
    # 0: auto (--serve: one per machine, default_parallel; else 1).
    parallel: int = 0


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. ``step`` bounds one decode step; a prefill gets ``step`` per
    ubatch of prompt. ``heartbeat``: a stage that sends nothing for that long
    (the agents beat every heartbeat/5 s) is lost, an agent that hears
    nothing from its orchestrator for that long ends, and no send to a stage
    waits longer. ``setup``: setting up an SSH host's agent (a build of
    llama.cpp there takes minutes)."""

    connect: float = 15.0
    ready: float = 600.0
    step: float = 120.0
    teardown: float = 15.0
    heartbeat: float = 30.0
    setup: float = 3600.0


@dataclass(frozen=True, slots=True)
class Recovery:
    """A lost stage (docs/recovery.md): the run in flight is repaired and
    replayed at most ``attempts`` times (0: a loss ends the run, as a fault),
    within ``deadline`` seconds of its first loss."""

    attempts: int = 2
    deadline: float = 120.0


@dataclass(frozen=True, slots=True)
class Inventory:
    path: Path
    model_path: str
    model_line: int
    hosts: dict[str, HostSpec]
    stages: tuple[StageSpec, ...]
    run: RunOptions = field(default_factory=RunOptions)
    timeouts: Timeouts = field(default_factory=Timeouts)
    recovery: Recovery = field(default_factory=Recovery)
    # model.send: the model lies on this machine (model_path, relative to the
    # inventory's folder) and each stage host is sent its stage file.
    send: bool = False

    def where(self, line: int) -> str:
        return f"{self.path}:{line}"

    def local_model_path(self) -> str:
        """The model path on this machine (``send: true``), relative to the
        inventory's folder when relative."""
        expanded = os.path.expanduser(self.model_path)
        if not os.path.isabs(expanded):
            expanded = str((self.path.parent / expanded).resolve())
        return expanded

    def model_path_for(self, host: HostSpec) -> str:
        """The model path as seen on ``host``. A relative path on a local host
        is relative to the inventory's folder; on an SSH host, to the login
        directory there. With ``send: true`` the one path is this machine's."""
        if self.send:
            return self.local_model_path()
        chosen = host.model_path or self.model_path
        if host.local:
            expanded = os.path.expanduser(chosen)
            if not os.path.isabs(expanded):
                expanded = str((self.path.parent / expanded).resolve())
            return expanded
        return chosen


# ------------------------------------------------------------------ parsing


class _Reader:
    """Typed access to YAML nodes, with the line of each for errors."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, node: yaml.Node | None, key: str, message: str) -> InventoryError:
        line = node.start_mark.line + 1 if node is not None else 1
        return InventoryError(f"{self.path}:{line}: {key}: {message}")

    def mapping(self, node: yaml.Node, key: str, allowed: tuple[str, ...]) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, key, "expected a mapping")
        result: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            name = key_node.value
            full = name if key == "inventory" else f"{key}.{name}"
            if not isinstance(key_node, yaml.ScalarNode) or name not in allowed:
                known = ", ".join(allowed)
                raise self.fail(key_node, full, f"unknown key (known: {known})")
            if name in result:
                raise self.fail(key_node, full, "given twice")
            result[name] = value_node
        return result

    def scalar(self, node: yaml.Node, key: str, kind: type) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, key, f"expected {_kind_name(kind)}")
        try:
            value = yaml.safe_load(yaml.serialize(node)) if node.value != "" else None
        except (yaml.YAMLError, ValueError, KeyError, AttributeError, TypeError, IndexError):
            # A tag that does not fit its text (!!bool maybe, !!int abc) or
            # that safe_load does not construct (!custom, !!python/...), or that
            # its constructor trips over (!!int -).
            got = f"{node.tag} {node.value!r}"
            raise self.fail(node, key, f"expected {_kind_name(kind)}, got {got}") from None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                raise self.fail(node, key, f"{node.value!r} is too large a number") from None
        if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
            value = str(node.value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(node, key, f"expected {_kind_name(kind)}, got {node.value!r}")
        return value

    def strings(self, node: yaml.Node, key: str) -> tuple[str, ...]:
        if isinstance(node, yaml.SequenceNode):
            return tuple(self.scalar(item, f"{key}[{i}]", str) for i, item in enumerate(node.value))
        return (self.scalar(node, key, str),)


def _kind_name(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[kind]


def _fill(reader: _Reader, cls: type, node: yaml.Node, key: str, **extra: Any) -> Any:
    """A frozen dataclass from a mapping node whose keys are its scalar fields."""
    known = {f.name: f for f in fields(cls) if f.name not in extra}
    values = dict(extra)
    for name, value_node in reader.mapping(node, key, tuple(known)).items():
        values[name] = reader.scalar(value_node, f"{key}.{name}", _field_type(known[name]))
    return cls(**values)


def _field_type(f: Any) -> type:
    text = f.type if isinstance(f.type, str) else f.type.__name__
    return {"int": int, "float": float, "str": str, "bool": bool}[text]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """Bytes from ``12GiB``, ``12 GB``, ``512MiB``, ``1.5T`` or a plain integer.
    GiB/MiB/KiB/TiB are powers of 1024; GB/MB/KB/TB (and G/M/K/T) of 1000, as
    written on the box. Raises ValueError."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (e.g. 12GiB, 16GB, 512MiB or bytes)")
    number, unit = match.group(1), (match.group(2) or "").lower()
    binary = "i" in unit
    scale = 1024 ** "bkmgt".index(unit[0]) if binary else _UNITS[unit[:1]]
    value = float(number) * scale
    if value < 1:
        raise ValueError(f"{text!r} is less than one byte")
    if not math.isfinite(value) or value >= 1 << 62:
        raise ValueError(f"{text!r} is more bytes than any host has")
    return int(value)


def _size(reader: _Reader, node: yaml.Node, key: str) -> int:
    if not isinstance(node, yaml.ScalarNode):
        raise reader.fail(node, key, "expected a size such as 12GiB")
    try:
        return parse_size(node.value)
    except ValueError as error:
        raise reader.fail(node, key, str(error)) from None


_HOST_CONVERTERS: dict[str, Callable[[_Reader, yaml.Node, str], Any]] = {
    "identity": lambda r, n, k: tuple(os.path.expanduser(p) for p in r.strings(n, k)),
    "known_hosts": lambda r, n, k: tuple(os.path.expanduser(p) for p in r.strings(n, k)),
    "memory": _size,
}


def _host(reader: _Reader, name: str, node: yaml.Node) -> HostSpec:
    key = f"hosts.{name}"
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
        raise reader.fail(node, key, "give {local: true} or an address")
    allowed = tuple(f.name for f in fields(HostSpec) if f.name not in ("name", "line"))
    values: dict[str, Any] = {}
    for field_name, value_node in reader.mapping(node, key, allowed).items():
        convert = _HOST_CONVERTERS.get(field_name)
        field_key = f"{key}.{field_name}"
        if convert is not None:
            values[field_name] = convert(reader, value_node, field_key)
        else:
            kind = _field_type(next(f for f in fields(HostSpec) if f.name == field_name))
            values[field_name] = reader.scalar(value_node, field_key, kind)
    host = HostSpec(name=name, line=node.start_mark.line + 1, **values)
    if host.local and host.address:
        raise reader.fail(node, key, "a host is either local: true or has an address, not both")
    if not host.local and not host.address:
        raise reader.fail(node, key, "needs an address (or local: true)")
    if not 0 < host.port < 65536:
        raise reader.fail(node, f"{key}.port", f"{host.port} is not a TCP port")
    if host.listen:
        try:
            parse_endpoint(host.listen)
        except ValueError as error:
            raise reader.fail(node, f"{key}.listen", str(error)) from None
        if host.share_process:
            raise reader.fail(
                node,
                f"{key}.share_process",
                "is for agents the orchestrator starts, not a hand-started one (listen:)",
            )
    elif host.listen_key:
        raise reader.fail(node, f"{key}.listen_key", "goes with listen: (a hand-started agent)")
    if host.insecure_no_host_key_check and host.known_hosts:
        raise reader.fail(node, key, "known_hosts and insecure_no_host_key_check exclude each other")
    if host.data and host.data not in DATA_MODES:
        raise reader.fail(node, f"{key}.data", f"must be one of {', '.join(DATA_MODES)}")
    if host.experts not in EXPERT_MODES:
        raise reader.fail(node, f"{key}.experts", f"must be one of {', '.join(EXPERT_MODES)}")
    if host.install not in INSTALL_MODES:
        raise reader.fail(node, f"{key}.install", f"must be one of {', '.join(INSTALL_MODES)}")
    if host.agent and (host.install != "auto" or host.agents_dir):
        name = "install" if host.install != "auto" else "agents_dir"
        raise reader.fail(
            node, f"{key}.{name}", "is for the agent ggufpipe sets up; this host names its agent:"
        )
    if not host.python.strip():
        raise reader.fail(node, f"{key}.python", "names no command")
    if host.listen and not host.agent:
        host = replace(host, agent=DEFAULT_AGENT)
    return host


def _stage(reader: _Reader, index: int, node: yaml.Node, hosts: dict[str, HostSpec]) -> StageSpec:
    key = f"stages[{index}]"
    entries = reader.mapping(node, key, ("host", "layers"))
    if "host" not in entries:
        raise reader.fail(node, key, "needs a host")
    host = reader.scalar(entries["host"], f"{key}.host", str)
    if host not in hosts:
        defined = ", ".join(hosts) or "none"
        raise reader.fail(
            entries["host"], f"{key}.host", f"'{host}' is not defined under hosts (defined: {defined})"
        )
    layers = None
    if "layers" in entries:
        layer_node = entries["layers"]
        if not isinstance(layer_node, yaml.SequenceNode) or len(layer_node.value) != 2:
            raise reader.fail(layer_node, f"{key}.layers", "expected [start, end) as two integers")
        start, end = (reader.scalar(item, f"{key}.layers", int) for item in layer_node.value)
        if start < 0 or end <= start:
            raise reader.fail(layer_node, f"{key}.layers", f"[{start}, {end}) is empty or reversed")
        layers = (start, end)
    return StageSpec(host=host, line=node.start_mark.line + 1, layers=layers)


def parse_inventory(text: str, path: Path) -> Inventory:
    reader = _Reader(path)
    try:
        root = yaml.compose(text)
    except RecursionError:
        raise InventoryError(f"{path}:1: not valid YAML: nested too deeply") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(error, "problem", None) or str(error)
        raise InventoryError(f"{path}:{line}: not valid YAML: {problem}") from None
    if root is None:
        raise InventoryError(f"{path}:1: the inventory is empty")
    keys = ("model", "hosts", "stages", "run", "timeouts", "data", "recovery")
    top = reader.mapping(root, "inventory", keys)
    for required in ("model", "hosts", "stages"):
        if required not in top:
            raise reader.fail(root, required, "missing")

    model = reader.mapping(top["model"], "model", ("path", "send"))
    if "path" not in model:
        raise reader.fail(top["model"], "model.path", "missing")
    model_path = reader.scalar(model["path"], "model.path", str)
    send = reader.scalar(model["send"], "model.send", bool) if "send" in model else False

    host_nodes = reader.mapping(top["hosts"], "hosts", tuple(_names(top["hosts"])))
    if not host_nodes:
        raise reader.fail(top["hosts"], "hosts", "define at least one host")
    hosts = {name: _host(reader, name, node) for name, node in host_nodes.items()}
    data = reader.scalar(top["data"], "data", str) if "data" in top else "auto"
    if data not in DATA_MODES:
        raise reader.fail(top["data"], "data", f"must be one of {', '.join(DATA_MODES)}")
    hosts = {name: replace(host, data=host.data or data) for name, host in hosts.items()}
    if send:
        for name, node in host_nodes.items():
            if hosts[name].model_path:
                raise reader.fail(
                    node,
                    f"hosts.{name}.model_path",
                    "has no use with model.send: true (the model is read on this machine and each "
                    "host is sent its stage file); remove one of the two",
                )

    stage_root = top["stages"]
    if not isinstance(stage_root, yaml.SequenceNode) or not stage_root.value:
        raise reader.fail(stage_root, "stages", "expected a list of at least one stage")
    stages = tuple(_stage(reader, i, node, hosts) for i, node in enumerate(stage_root.value))
    first_on: dict[str, int] = {}
    for index, stage in enumerate(stages):
        if hosts[stage.host].listen and stage.host in first_on:
            raise InventoryError(
                f"{path}:{stage.line}: stages[{index}]: stage {first_on[stage.host]} runs on {stage.host} "
                "already, and a hand-started agent (listen:) serves one stage: start one agent per stage, "
                "each with its own --listen address, and give each its own host entry"
            )
        first_on.setdefault(stage.host, index)
        if hosts[stage.host].spare:
            raise InventoryError(
                f"{path}:{stage.line}: stages[{index}].host: {stage.host} is a spare (spare: true at line "
                f"{hosts[stage.host].line}), which recovery moves a lost stage to; name another host, "
                "or remove spare: true"
            )
    given = [stage.layers is not None for stage in stages]
    if any(given) and not all(given):
        missing = stages[given.index(False)]
        raise InventoryError(
            f"{path}:{missing.line}: stages[{given.index(False)}].layers: give layers on every "
            "stage, or on none to split automatically"
        )

    run = _fill(reader, RunOptions, top["run"], "run") if "run" in top else RunOptions()
    timeouts = _fill(reader, Timeouts, top["timeouts"], "timeouts") if "timeouts" in top else Timeouts()
    recovery = _fill(reader, Recovery, top["recovery"], "recovery") if "recovery" in top else Recovery()
    if recovery.attempts < 0:
        raise reader.fail(top["recovery"], "recovery.attempts", "must be 0 (off) or more")
    if not 0 < recovery.deadline < math.inf:
        raise reader.fail(top["recovery"], "recovery.deadline", "must be a positive number of seconds")
    inventory = Inventory(
        path=path,
        model_path=model_path,
        model_line=model["path"].start_mark.line + 1,
        hosts=hosts,
        stages=stages,
        run=run,
        timeouts=timeouts,
        recovery=recovery,
        send=send,
    )
    check_run_options(inventory.run, lambda key, message: _run_error(top.get("run"), reader, key, message))
    for name in ("connect", "ready", "step", "teardown", "heartbeat", "setup"):
        if not 0 < getattr(timeouts, name) < math.inf:
            node = top.get("timeouts")
            raise reader.fail(node, f"timeouts.{name}", "must be a positive number of seconds")
    return inventory


def _names(node: yaml.Node) -> list[str]:
    if isinstance(node, yaml.MappingNode):
        return [key.value for key, _ in node.value if isinstance(key, yaml.ScalarNode)]
    return []


def _run_error(node: yaml.Node | None, reader: _Reader, key: str, message: str) -> InventoryError:
    return reader.fail(node, f"run.{key}", message)


def check_run_options(run: RunOptions, fail: Callable[[str, str], Exception]) -> None:
    """Range checks shared by the inventory and the command line."""
    if run.max_tokens < 1:
        raise fail("max_tokens", "must be at least 1")
    # Exactly what a stage accepts (one definition, ggufpipe_agent.wire.records).
    key, problem = sampling_problem(run.temperature, run.top_k, run.top_p, run.seed)
    if key:
        raise fail(key, problem)
    if run.context < 16:
        raise fail("context", "must be at least 16")
    if run.ubatch < 1:
        raise fail("ubatch", "must be at least 1")
    if run.activation_dtype not in ACTIVATION_DTYPES:
        raise fail("activation_dtype", f"must be one of {', '.join(ACTIVATION_DTYPES)}")
    if run.feedback not in FEEDBACK_MODES:
        raise fail("feedback", f"must be one of {', '.join(FEEDBACK_MODES)}")
    if run.reuse not in REUSE_MODES:
        raise fail("reuse", f"must be one of {', '.join(REUSE_MODES)}")
    if not 0 <= run.parallel <= MAX_PARALLEL:
        raise fail("parallel", f"must be 1 to {MAX_PARALLEL} runs in flight at once, or 0 (auto)")


def default_parallel(inventory: Inventory, cores: int) -> int:
    """The server's runs in flight when neither ``--parallel`` nor
    ``run.parallel`` says: one per machine the stages run on, so every machine
    is busy. Stages that share a machine share its cores: each one's steps
    use them all (``threads: 0``), and runs in flight on the same cores make
    llama.cpp's thread teams wait for each other (3 local stages with 3 runs
    in flight served 0.36x the requests/s of one at a time, docs/bench-server.md).
    So a machine's stages count one each only where they cannot collide:
    this machine (``local``), not one shared process, each stage's
    ``threads`` given and together at most ``cores``. Say ``--parallel``
    for anything else (an SSH host whose stages have cores of their own)."""
    machines: dict[tuple[object, ...], list[HostSpec]] = {}
    for stage in inventory.stages:
        host = inventory.hosts[stage.host]
        key: tuple[object, ...] = ("local",) if host.local else ("ssh", host.address, host.port)
        machines.setdefault(key, []).append(host)
    total = 0
    for key, hosts in machines.items():
        apart = (
            key == ("local",)
            and not any(host.share_process for host in hosts)
            and all(host.threads > 0 for host in hosts)
            and sum(host.threads for host in hosts) <= cores
        )
        total += len(hosts) if apart else 1
    return max(1, total)


def load_inventory(path: str | os.PathLike[str]) -> Inventory:
    target = Path(path)
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(f"{target}: no such inventory file") from None
    except OSError as error:
        raise InventoryError(f"{target}: cannot read ({error.strerror})") from None
    except UnicodeDecodeError:
        raise InventoryError(f"{target}: not a UTF-8 text file") from None
    return parse_inventory(text, target)


def with_run_options(inventory: Inventory, **overrides: Any) -> Inventory:
    """Command-line overrides (``None`` means not given)."""
    given = {key: value for key, value in overrides.items() if value is not None}
    run = replace(inventory.run, **given)

    def fail(key: str, message: str) -> InventoryError:
        return InventoryError(f"--{key.replace('_', '-')}: {message}")

    check_run_options(run, fail)
    return replace(inventory, run=run)


def with_data_mode(inventory: Inventory, mode: str | None) -> Inventory:
    """``--data``: every host's data mode (``None`` means not given)."""
    if mode is None:
        return inventory
    if mode not in DATA_MODES:
        raise InventoryError(f"--data: must be one of {', '.join(DATA_MODES)}")
    hosts = {name: replace(host, data=mode) for name, host in inventory.hosts.items()}
    return replace(inventory, hosts=hosts)


# ------------------------------------------------------------------ layers


def assign_layers(inventory: Inventory, block_count: int) -> list[tuple[int, int]]:
    """Each stage's [start, end): as given (checked: no overlap, no gap, the
    model's end reached) or split evenly by block count when no stage gives
    layers. Runs split by memory instead (core.placement), which checks given
    ranges here."""
    stages = inventory.stages
    if stages[0].layers is None:
        if len(stages) > block_count:
            raise InventoryError(
                f"{inventory.where(stages[0].line)}: stages: {len(stages)} stages for a model of "
                f"only {block_count} blocks"
            )
        base, extra = divmod(block_count, len(stages))
        ranges, start = [], 0
        for index in range(len(stages)):
            end = start + base + (1 if index < extra else 0)
            ranges.append((start, end))
            start = end
        return ranges
    ranges = []
    expected = 0
    for index, stage in enumerate(stages):
        assert stage.layers is not None
        start, end = stage.layers
        where = f"{inventory.where(stage.line)}: stages[{index}].layers"
        if start < expected:
            raise InventoryError(
                f"{where}: [{start}, {end}) overlaps the previous stage (ends at {expected})"
            )
        if start > expected:
            raise InventoryError(f"{where}: [{start}, {end}) leaves blocks [{expected}, {start}) unassigned")
        if end > block_count:
            raise InventoryError(f"{where}: [{start}, {end}) goes past the model's {block_count} blocks")
        ranges.append((start, end))
        expected = end
    if expected != block_count:
        last = stages[-1]
        raise InventoryError(
            f"{inventory.where(last.line)}: stages[{len(stages) - 1}].layers: the stages end at "
            f"block {expected}, the model has {block_count} blocks"
        )
    return ranges
