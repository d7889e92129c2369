"""Which architectures a stage may run, and what a stage file must carry for each.

An architecture is accepted only once a test proves that a split chain of
stages gives the same greedy tokens as the whole model in one llama.cpp
context. Everything else is refused before anything loads: a pipeline that
silently computes something else is worse than one that says no.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggufpipe_agent.errors import UnsupportedArchitecture

ISSUES_URL = "https://github.com/ggufpipe/ggufpipe/issues"


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str
    #: How the split was proven identical to the whole model (README table).
    verified: str


SUPPORTED: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture("llama", "SmolLM2-135M-Instruct (real) and synthetic; Llama 2/3, Mistral 7B"),
        Architecture("qwen2", "synthetic GGUF with random weights"),
        Architecture("qwen3", "synthetic GGUF with random weights"),
    )
}


def check_architecture(arch: str, where: str) -> Architecture:
    support = SUPPORTED.get(arch)
    if support is None:
        accepted = ", ".join(sorted(SUPPORTED))
        raise UnsupportedArchitecture(
            f"{where}: architecture '{arch}' is not verified for split execution "
            f"(accepted: {accepted}); ask for it at {ISSUES_URL} with a link to a small "
            f"GGUF of that architecture"
        )
    return support


def stage_metadata_overrides(
    arch: str, reader: object, start: int, end: int
) -> dict[str, tuple[object, object, object]]:
    """Metadata a stage file of ``arch`` must carry instead of the copied value:
    ``{key: (value, value_type, sub_type)}``. Empty for the llama family, which
    derives nothing from the block index or count."""
    return {}
