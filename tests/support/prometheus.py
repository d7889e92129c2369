"""A strict reader of Prometheus' text format, for the tests of ``/metrics``."""

from __future__ import annotations

import re

LINE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_]\w*="(?:[^"\\]|\\.)*"(?:,[a-zA-Z_]\w*="(?:[^"\\]|\\.)*")*)\})? (\S+)$'
)
LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus' text format, strictly: every line a HELP, a TYPE (before
    its samples, once per family) or a sample of a declared family."""
    assert text.endswith("\n")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            assert len(line.split(" ", 3)) == 4, line
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "summary", "histogram", "untyped") and name not in types, line
            types[name] = kind
            continue
        match = LINE.match(line)
        assert match, f"not a sample: {line!r}"
        name, labels, value = match.group(1), match.group(3) or "", match.group(4)
        family = re.sub(r"_(sum|count)$", "", name) if name not in types else name
        assert family in types, f"{name}: no TYPE before it"
        key = (name, tuple(sorted(LABEL.findall(labels))))
        assert key not in samples, f"{line!r} twice"
        samples[key] = float(value)
    return samples
