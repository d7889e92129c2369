"""The inventory: model, hosts and ordered stages, read from YAML.

Pure: parsing and checking do no I/O beyond reading the file. Every error
names the file, the line and the key, e.g.
``inventory.yaml:7: stages[1].host: 'gpu-c' is not defined under hosts``.
The nodes are read by :mod:`ggufpipe_tui.core.yamlnodes`; what ggufpipe
decides where the inventory says nothing (the layer split, the runs in
flight) is :mod:`ggufpipe_tui.core.inventory_policy`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from ggufpipe_agent.wire.endpoints import parse_endpoint
from ggufpipe_agent.wire.records import sampling_problem
from ggufpipe_tui.core.errors import InventoryError
from ggufpipe_tui.core.yamlnodes import NodeReader, field_type, fill, size_of

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
    # run's KV cache in its own slot (the server's --parallel; docs/architecture.md, "Runs in flight").
    # 0: auto (--serve: one per machine, default_parallel; else 1).
    parallel: int = 0
    # The decode steps of the runs in flight computed in one batch per stage
    # (off: each alone, so each run's output is what it is alone).
    batching: bool = True
    #: llama-server's other sampling fields a request set, by name
    #: (records.SamplingParams); empty from an inventory.
    extra: tuple[tuple[str, Any], ...] = ()


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


_HOST_CONVERTERS: dict[str, Callable[[NodeReader, yaml.Node, str], Any]] = {
    "identity": lambda r, n, k: tuple(os.path.expanduser(p) for p in r.strings(n, k)),
    "known_hosts": lambda r, n, k: tuple(os.path.expanduser(p) for p in r.strings(n, k)),
    "memory": size_of,
}


def _host(reader: NodeReader, name: str, node: yaml.Node) -> HostSpec:
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
            kind = field_type(next(f for f in fields(HostSpec) if f.name == field_name))
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


def _stage(reader: NodeReader, index: int, node: yaml.Node, hosts: dict[str, HostSpec]) -> StageSpec:
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
    reader = NodeReader(path)
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

    run = fill(reader, RunOptions, top["run"], "run", extra=()) if "run" in top else RunOptions()
    timeouts = fill(reader, Timeouts, top["timeouts"], "timeouts") if "timeouts" in top else Timeouts()
    recovery = fill(reader, Recovery, top["recovery"], "recovery") if "recovery" in top else Recovery()
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


def _run_error(node: yaml.Node | None, reader: NodeReader, key: str, message: str) -> InventoryError:
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
