"""How the views say things: one wording for the TUI and headless mode.

Plain functions of events and results, no Textual: the terminal UI styles
these strings, headless mode prints them.
"""

from __future__ import annotations

from collections.abc import Iterable

from ggufpipe_agent.wire.protocol import Hello, ModelFacts
from ggufpipe_tui.core.events import AgentConnected, AgentSetup, DataPath, RunResult, StageDelivery
from ggufpipe_tui.core.plan import StagePlan

STOP_WORDS = {"eos": "end of text", "max_tokens": "max tokens", "stopped": "stopped"}


def format_bytes(count: int, compact: bool = False) -> str:
    units = ("B", "K", "M", "G", "T") if compact else ("B", "KiB", "MiB", "GiB", "TiB")
    value = float(count)
    for unit in units:
        if value < 1024 or unit == units[-1]:
            if unit == "B":
                return f"{int(value)}{'' if compact else ' '}{unit}"
            digits = 0 if compact and value >= 10 else 1
            return f"{value:.{digits}f}{'' if compact else ' '}{unit}"
        value /= 1024
    return str(count)  # unreachable


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s"


def device_name(hello: Hello) -> str:
    return hello.devices[0].description if hello.devices else hello.backend.upper()


def agent_line(event: AgentConnected) -> str:
    hello = event.hello
    return (
        f"agent on {event.host} ({event.where}), pid {hello.pid}, llama-cpp-python "
        f"{hello.llama_cpp}, {device_name(hello)}"
    )


def agent_processes(connected: Iterable[AgentConnected]) -> list[tuple[str, int, tuple[int, ...]]]:
    """(host, pid, stages) per agent process: stages whose agents are one
    process (share_process: true) come as one entry, in stage order."""
    groups: dict[tuple[str, int], list[int]] = {}
    for event in sorted(connected, key=lambda e: e.stage):
        groups.setdefault((event.host, event.hello.pid), []).append(event.stage)
    return [(host, pid, tuple(stages)) for (host, pid), stages in groups.items()]


def model_line(facts: ModelFacts, stages: int, hosts: int) -> str:
    return (
        f"{facts.stem} · {facts.architecture} · {facts.file_type} · {format_bytes(facts.file_size)} · "
        f"{facts.block_count} layers · {stages} stages on {hosts} host{'s' if hosts > 1 else ''}"
    )


def stage_plan_line(stage: StagePlan) -> str:
    experts = ", experts in RAM" if stage.engine.experts_in_ram else ""
    return (
        f"stage {stage.stage_index}: layers [{stage.layer_start}, {stage.layer_end_exclusive}) on "
        f"{stage.node_id}, ~{format_bytes(stage.estimated_bytes)}{experts}"
    )


TRANSPORT_WORDS = {
    "unix": "direct, Unix socket",
    "tls": "direct, mutual TLS",
    "self": "direct, within the stage",
}


def data_path_line(path: DataPath) -> str:
    """How one link of the session carries its objects."""
    what = "token ring" if path.ring else "activations"
    head = f"{what} stage {path.producer} → stage {path.consumer}: "
    if path.data == "relay":
        return head + f"relay through the orchestrator ({path.reason})"
    where = f" at {path.endpoint}" if path.endpoint and path.transport == "tls" else ""
    probe = f", probe {path.round_trip_ms:.1f} ms" if path.transport != "self" else ""
    return head + TRANSPORT_WORDS.get(path.transport, path.transport) + where + probe


def stage_state_line(stage: int, state: str, detail: str) -> str:
    return f"stage {stage} → {state}" + (f": {detail}" if detail else "")


def result_summary(result: RunResult) -> str:
    """How a run ended, with its figures when it produced tokens."""
    if result.outcome == "faulted":
        return f"✖ faulted: {result.failure}"
    if not result.tokens:
        return f"{result.outcome}: {result.failure or 'stopped before the first token'}"
    t = result.timings
    why = STOP_WORDS.get(result.stop_reason, result.outcome)
    summary = (
        f"{why} · {len(result.tokens)} tokens · first after {t.ttft_ms:.0f} ms · "
        f"{t.decode_tokens_per_s:.1f} tok/s"
    )
    return summary + (f" · {reuse_line(result)}" if result.prompt_reused else "")


def reuse_line(result: RunResult) -> str:
    """What a run kept of the previous one (prefix reuse)."""
    return f"reused {result.prompt_reused} of {len(result.prompt_tokens)} prompt tokens"


def format_rate(bytes_per_second: float) -> str:
    """A transfer rate in MB/s (10^6 bytes, as network rates are quoted)."""
    digits = 0 if bytes_per_second >= 10e6 else 1
    return f"{bytes_per_second / 1e6:.{digits}f} MB/s"


def _part_of(done: int, size: int) -> str:
    """``3.1/12.4 GiB`` (``41.0/62.1 MiB`` under a GiB)."""
    unit, scale = ("GiB", 2**30) if size >= 2**30 else ("MiB", 2**20)
    return f"{done / scale:.1f}/{size / scale:.1f} {unit}"


def setup_line(event: AgentSetup) -> str:
    """A host's agent set-up: its step, then how it was done and how long it took."""
    if event.state != "done":
        return event.detail
    if event.how == "ready":
        return "its agent is set up already"
    sent = f", {format_bytes(event.bytes_sent)} sent" if event.bytes_sent else ""
    return f"agent {event.how} in {format_seconds(event.seconds)}{sent}"


def delivery_line(event: StageDelivery) -> str:
    """Where a stage file's delivery stands: ``sending 3.1/12.4 GiB, 240 MB/s,
    ETA 38 s`` while it goes, what it took once done."""
    if event.state == "checking":
        return f"checking what the host has of {format_bytes(event.size)}"
    if event.state == "waiting":
        return "waiting: another transfer is writing this file on the host"
    if event.state == "sending":
        text = f"sending {_part_of(event.done, event.size)}"
        if event.rate > 0:
            text += f", {format_rate(event.rate)}"
        eta = event.eta
        if eta is not None:
            text += f", ETA {'<1 s' if eta < 1 else f'{eta:.0f} s' if eta < 60 else format_seconds(eta)}"
        return text
    if event.outcome == "cached":
        return f"on the host already ({format_bytes(event.size)}), nothing sent"
    took = format_seconds(event.seconds)
    rate = f", {format_rate(event.sent / event.seconds)}" if event.seconds > 0 and event.sent else ""
    if event.outcome == "resumed":
        kept = format_bytes(event.size - event.sent)
        whole = format_bytes(event.size)
        return f"resumed: sent {format_bytes(event.sent)} of {whole} in {took}{rate} ({kept} were there)"
    return f"sent {format_bytes(event.sent)} in {took}{rate}"
