"""How the views say things: one wording for the TUI and headless mode.

Plain functions of events and results, no Textual: the terminal UI styles
these strings, headless mode prints them.
"""

from __future__ import annotations

from ggufpipe_agent.protocol import Hello, ModelFacts
from ggufpipe_tui.core.events import AgentConnected, RunResult
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


def model_line(facts: ModelFacts, stages: int, hosts: int) -> str:
    return (
        f"{facts.stem} · {facts.architecture} · {facts.file_type} · {format_bytes(facts.file_size)} · "
        f"{facts.block_count} layers · {stages} stages on {hosts} host{'s' if hosts > 1 else ''}"
    )


def stage_plan_line(stage: StagePlan) -> str:
    return (
        f"stage {stage.stage_index}: layers [{stage.layer_start}, {stage.layer_end_exclusive}) on "
        f"{stage.node_id}, ~{format_bytes(stage.estimated_bytes)}"
    )


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
