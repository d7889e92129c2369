"""A remote shell's words: paths it expands, output it wrote."""

from __future__ import annotations

import shlex


def shell_path(path: str) -> str:
    """A quoted path whose leading ~/ the remote shell still expands."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def output_text(output: bytes | str | None) -> str:
    """An exec session's output (bytes with encoding=None) as text."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
