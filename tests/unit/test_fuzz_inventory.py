"""Property-based fuzzing of the inventory parser (Hypothesis; no model, no
agent process, no file: :func:`parse_inventory` takes the text).

The contract: any text gives an :class:`Inventory` or an
:class:`InventoryError` (a GgufpipeError) whose message names the file and a
line (``PATH:LINE: ...``), never another exception; and an inventory that is
accepted holds what the rest of the orchestrator relies on (its sampling is
what a stage accepts, its timeouts are positive numbers, every stage names a
defined host, ...). Each property and its budget (``max_examples``; the whole
file takes about 10 s on two cores); the ``@example`` inputs are what the
fuzzing found, kept so that they are always tried:

* ``test_any_text_is_an_inventory_or_an_error`` (300): random text, half of
  it drawn from YAML's punctuation so that it is often YAML of some shape.
* ``test_any_yaml_document_is_an_inventory_or_an_error`` (300): any YAML
  document (nested maps, lists and scalars: huge integers, NaN, infinities,
  non-string keys) dumped by PyYAML.
* ``test_inventory_shaped_documents`` (600): documents with the inventory's
  real keys (model, hosts with every host field, stages, run, timeouts,
  data), each value valid, borderline or of the wrong type.
* ``test_tagged_scalars`` (400): a valid inventory's text with some of its
  scalars carrying an explicit YAML tag (``!!int``, ``!!bool``,
  ``!!timestamp``, ``!!python/name:...``, ``!custom``, ...) and odd values.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.wire.records import sampling_problem
from ggufpipe_tui.core.inventory import (
    DATA_MODES,
    EXPERT_MODES,
    HostSpec,
    Inventory,
    InventoryError,
    RunOptions,
    Timeouts,
    check_run_options,
    parse_inventory,
)

PATH = Path("fuzz/inventory.yaml")
ERROR = re.compile(rf"^{re.escape(str(PATH))}:\d+: ")
VALID = """\
model:
  path: models/m.gguf
hosts:
  here: {local: true}
stages:
  - {host: here}
"""


def parses_or_refuses(text: str) -> Inventory | None:
    """The inventory of ``text``, or None when it is refused as the contract
    says; any other exception fails the test."""
    try:
        inventory = parse_inventory(text, PATH)
    except InventoryError as error:
        assert isinstance(error, GgufpipeError)
        assert ERROR.match(str(error)), f"the error names no file and line: {error}"
        note("refused")
        return None
    note("accepted")
    check_accepted(inventory)
    return inventory


def note(outcome: str) -> None:
    """Counted in ``--hypothesis-show-statistics`` (outside a property: nothing)."""
    with contextlib.suppress(InvalidArgument):
        event(outcome)


def check_accepted(inventory: Inventory) -> None:
    """What the orchestrator takes for granted of an inventory that parsed."""
    assert isinstance(inventory, Inventory)
    assert isinstance(inventory.model_path, str)
    assert inventory.hosts and inventory.stages
    for name, host in inventory.hosts.items():
        assert host.name == name
        assert host.local != bool(host.address), host
        assert 0 < host.port < 65536
        assert host.data in DATA_MODES
        assert host.experts in EXPERT_MODES
        assert host.memory >= 0
        _check_types(host, HostSpec)
    for stage in inventory.stages:
        assert stage.host in inventory.hosts
        assert not inventory.hosts[stage.host].spare, "a stage on a spare host"
    layers = [stage.layers for stage in inventory.stages]
    assert all(r is None for r in layers) or all(r is not None and 0 <= r[0] < r[1] for r in layers)
    run = inventory.run
    _check_types(run, RunOptions)
    assert sampling_problem(run.temperature, run.top_k, run.top_p, run.seed) == ("", "")
    check_run_options(run, lambda key, message: AssertionError(f"run.{key}: {message}"))
    _check_types(inventory.timeouts, Timeouts)
    for f in fields(Timeouts):
        value = getattr(inventory.timeouts, f.name)
        assert value > 0, f"timeouts.{f.name} = {value!r} accepted"  # NaN is not > 0 either


def _check_types(record: Any, cls: type) -> None:
    kinds = {"int": int, "float": float, "str": str, "bool": bool}
    for f in fields(cls):
        kind = kinds.get(f.type) if isinstance(f.type, str) else None
        if kind is None:
            continue
        value = getattr(record, f.name)
        assert isinstance(value, kind) and (kind is bool or not isinstance(value, bool)), (f.name, value)


# --------------------------------------------------------------- strategies

text = st.text(st.characters(exclude_categories=["Cs"]), max_size=20)
word = st.text(st.characters(exclude_categories=["Cs", "Cc", "Zs"]), min_size=1, max_size=20)
yaml_punctuation = st.lists(
    st.sampled_from(list(":-[]{},#&*!|>'\"%@`?~ \n\t.0123456789abcxyz") + ["\n  ", ": ", "- ", "!!", "<<"]),
    max_size=60,
).map("".join)
huge = st.sampled_from([-(1 << 63) - 1, -(1 << 63), -1, 0, 1, (1 << 31), (1 << 63), 10**400])
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    huge,
    st.floats(),  # NaN and the infinities included
    text,
)
keys = st.one_of(text, st.integers(-2, 2), st.booleans(), st.none())
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=20,
)


def mostly(
    valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any], one_in: int = 6
) -> st.SearchStrategy[Any]:
    """A valid value, but one time in ``one_in`` an odd one (borderline, of
    the wrong type, or any document at all)."""
    # (Hypothesis favours an integer's bounds: the odd one is one in the middle.)
    return st.integers(0, one_in - 1).flatmap(lambda i: odd | documents if i == one_in // 2 else valid)


def some_of(entries: dict[str, st.SearchStrategy[Any]], most: int) -> st.SearchStrategy[dict[str, Any]]:
    """A mapping of a few of ``entries`` (each with its own value strategy)."""
    chosen = st.lists(st.sampled_from(sorted(entries)), max_size=most, unique=True)
    return chosen.flatmap(lambda names: st.fixed_dictionaries({n: entries[n] for n in names}))


sizes = st.one_of(
    st.integers(-5, 1 << 40),
    st.sampled_from(
        [
            "12GiB",
            "16 GB",
            "512MiB",
            "1.5T",
            "0.1",
            "0",
            "1e3",
            "1 KiB",
            "9" * 400,
            "9" * 400 + "TiB",
            "",
            "GiB",
        ]
    ),
    st.builds(
        lambda n, unit: f"{n}{unit}",
        st.floats(0, 1e30),
        st.sampled_from(["", "B", "K", "KiB", "MB", "G", "Ti"]),
    ),
)
numbers = st.one_of(st.floats(), st.integers(-5, 10), huge)
endpoints = st.sampled_from(
    ["unix:/tmp/a.sock", "unix:", "127.0.0.1:7000", "tcp::1", "h:0", "h:65536", "h:x", ":", "h:٣"]
)
HOST_EXTRAS: dict[str, st.SearchStrategy[Any]] = {
    "port": mostly(st.integers(1, 65535), st.integers(-1, 70000) | huge),
    "user": text,
    "identity": text | st.lists(text, max_size=3),
    "known_hosts": text | st.lists(text, max_size=3),
    "insecure_no_host_key_check": mostly(st.booleans(), st.integers(0, 1)),
    "agent": text,
    "agents_dir": text,
    "install": mostly(st.sampled_from(["auto", "push", "build"]), text),
    "python": text,
    "model_path": text,
    "listen": endpoints | text,
    "listen_key": text,
    "threads": mostly(st.integers(0, 64), st.integers(-2, -1)),
    "gpu_layers": mostly(st.integers(-1, 64), st.floats()),
    "experts": mostly(st.sampled_from(EXPERT_MODES), st.sampled_from(["", "cpu", "GPU"])),
    "cache_dir": text,
    "memory": sizes,
    "data": mostly(st.sampled_from(DATA_MODES), st.sampled_from(["", "fast"])),
    "link_address": text,
    "share_process": mostly(st.booleans(), text),
    "spare": mostly(st.booleans(), text),
}
assert set(HOST_EXTRAS) | {"local", "address"} == {f.name for f in fields(HostSpec)} - {"name", "line"}, (
    "a HostSpec field is not fuzzed"
)
hosts_entry = mostly(
    st.fixed_dictionaries({"local": st.just(True)}) | st.fixed_dictionaries({"address": word}),
    st.fixed_dictionaries({"local": st.booleans(), "address": text}) | st.just({}) | st.none(),
).flatmap(
    lambda base: (
        some_of(HOST_EXTRAS, 3).map(lambda extra: {**base, **extra})
        if isinstance(base, dict)
        else st.just(base)
    )
)
RUN_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": mostly(st.integers(1, 4096), st.integers(-1, 0) | huge),
    "temperature": mostly(st.floats(0, 2), numbers),
    "top_k": mostly(st.integers(0, 100), st.integers(-1, 0) | huge),
    "top_p": mostly(st.floats(0.01, 1), numbers),
    "seed": mostly(st.integers(-(1 << 63), (1 << 63) - 1), huge),
    "context": mostly(st.integers(16, 8192), st.integers(0, 16)),
    "ubatch": mostly(st.integers(1, 1024), st.integers(-1, 1)),
    "activation_dtype": mostly(st.sampled_from(["float32", "float16"]), st.sampled_from(["bfloat16", ""])),
    "chat": mostly(st.booleans(), st.sampled_from(["yes", 1])),
    "ignore_eos": mostly(st.booleans(), st.sampled_from(["no", 0])),
    "feedback": mostly(st.sampled_from(["ring", "orchestrator"]), st.sampled_from(["none", ""])),
    "reuse": mostly(st.sampled_from(["cache", "exact"]), st.sampled_from(["none", "", "warm"])),
    "parallel": mostly(st.integers(0, 64), st.integers(-2, -1) | huge),
    "batching": mostly(st.booleans(), st.sampled_from(["sometimes", 2])),
}
# extra: a request's llama-server sampling fields, never read from an inventory.
assert set(RUN_FIELDS) == {f.name for f in fields(RunOptions)} - {"extra"}, "a RunOptions field is not fuzzed"
TIMEOUT_FIELDS = {
    f.name: mostly(st.floats(0.1, 1e4) | st.integers(1, 1000), numbers) for f in fields(Timeouts)
}


@st.composite
def inventory_documents(draw: st.DrawFn) -> Any:
    """Inventories, most of them valid or nearly so, with the real keys."""
    names = draw(st.lists(word, min_size=1, max_size=3, unique=True)) if draw(st.integers(0, 9)) != 5 else []
    hosts = {name: draw(hosts_entry) for name in names}
    layered = draw(st.booleans())
    stage = (
        st.fixed_dictionaries(
            {"host": mostly(st.sampled_from(names) if names else text, text)},
            optional={
                "layers": mostly(
                    st.lists(st.integers(-1, 40), min_size=2, max_size=2).map(sorted),
                    st.lists(st.integers(-2, 40), max_size=3),
                )
            },
        )
        if layered
        else st.fixed_dictionaries({"host": mostly(st.sampled_from(names) if names else text, text)})
    )
    top = {
        "model": mostly(
            st.fixed_dictionaries(
                {"path": mostly(word, text)}, optional={"send": mostly(st.booleans(), text)}
            ),
            st.just({}),
        ),
        "hosts": mostly(st.just(hosts), st.just({})),
        "stages": mostly(st.lists(stage, min_size=1, max_size=3), st.just([])),
        "run": mostly(some_of(RUN_FIELDS, 5), st.none()),
        "timeouts": mostly(some_of(TIMEOUT_FIELDS, 3), st.none()),
        "data": mostly(st.sampled_from(DATA_MODES), st.sampled_from(["", "fast"])),
    }
    document: dict[Any, Any] = {name: draw(top[name]) for name in ("model", "hosts", "stages")}
    for name in draw(st.lists(st.sampled_from(["run", "timeouts", "data"]), unique=True)):
        document[name] = draw(top[name])
    if draw(st.integers(0, 19)) == 10:  # a required key missing, or an unknown one
        document.pop(draw(st.sampled_from(["model", "hosts", "stages"])))
    if draw(st.integers(0, 19)) == 10:
        document[draw(keys)] = draw(documents)
    return document


def dump(document: Any, flow: bool | None) -> str:
    return yaml.safe_dump(document, default_flow_style=flow, allow_unicode=True, sort_keys=False)


TAGS = [
    "!!int",
    "!!float",
    "!!bool",
    "!!str",
    "!!null",
    "!!timestamp",
    "!!binary",
    "!!set",
    "!!omap",
    "!!pairs",
    "!!seq",
    "!!map",
    "!!merge",
    "!!value",
    "!!python/name:os.system",
    "!!python/object/apply:os.system",
    "!custom",
    "!",
    "!<tag:yaml.org,2002:int>",
]
ODD = [
    "abc",
    "1",
    "-1",
    "0x1F",
    "0o17",
    "1_000",
    "1e999",
    ".nan",
    "-.inf",
    "yes",
    "no",
    "on",
    "maybe",
    "~",
    "2001-12-14",
    "2001-12-14t21:59:43.10-05:00",
    "'quoted'",
    '""',
    "SGVsbG8=",
    "9" * 400,
    "[1, 2]",
    "{a: 1}",
]
SLOTS = {
    "model.path": "models/m.gguf",
    "model.send": "false",
    "hosts.local": "true",
    "hosts.port": "22",
    "hosts.memory": "12GiB",
    "hosts.identity": "~/.ssh/id",
    "hosts.threads": "0",
    "hosts.data": "auto",
    "stages.host": "here",
    "stages.start": "0",
    "stages.end": "4",
    "run.max_tokens": "16",
    "run.temperature": "0.5",
    "run.top_k": "40",
    "run.top_p": "0.9",
    "run.seed": "7",
    "run.context": "512",
    "run.chat": "true",
    "run.activation_dtype": "float16",
    "timeouts.connect": "15",
    "timeouts.heartbeat": "30.5",
    "data": "relay",
}
TEMPLATE = """\
model:
  path: {model.path}
  send: {model.send}
hosts:
  here:
    local: {hosts.local}
    port: {hosts.port}
    memory: {hosts.memory}
    identity: {hosts.identity}
    threads: {hosts.threads}
    data: {hosts.data}
stages:
  - host: {stages.host}
    layers: [{stages.start}, {stages.end}]
run:
  max_tokens: {run.max_tokens}
  temperature: {run.temperature}
  top_k: {run.top_k}
  top_p: {run.top_p}
  seed: {run.seed}
  context: {run.context}
  chat: {run.chat}
  activation_dtype: {run.activation_dtype}
timeouts:
  connect: {timeouts.connect}
  heartbeat: {timeouts.heartbeat}
data: {data}
"""


def fill(values: dict[str, str]) -> str:
    out = TEMPLATE
    for slot, default in SLOTS.items():
        out = out.replace("{" + slot + "}", values.get(slot, default))
    return out


@st.composite
def tagged_texts(draw: st.DrawFn) -> str:
    chosen = draw(st.lists(st.sampled_from(sorted(SLOTS)), min_size=1, max_size=4, unique=True))
    values = {}
    for slot in chosen:
        value = draw(
            st.sampled_from(ODD) | st.just(SLOTS[slot]) | yaml_punctuation.filter(lambda s: "\n" not in s)
        )
        tag = draw(st.sampled_from(TAGS) | st.just(""))
        values[slot] = f"{tag} {value}".strip() if tag else value
    return fill(values)


# --------------------------------------------------------------- properties


def test_the_templates_are_valid() -> None:
    """The fuzzed documents start from inventories that parse."""
    assert parses_or_refuses(VALID) is not None
    assert parses_or_refuses(fill({})) is not None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=text | yaml_punctuation | st.text(max_size=200))
@example(source="")
@example(source="---\n...\n---\n")
@example(source="a: &x [*x]")
@example(source="[" * 2000 + "]" * 2000)  # deeper than Python's recursion limit
def test_any_text_is_an_inventory_or_an_error(source: str) -> None:
    # Text read from a file (load_inventory reads UTF-8) has no lone surrogates.
    parses_or_refuses(source.encode("utf-8", "replace").decode("utf-8"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=documents, flow=st.sampled_from([None, True, False]))
def test_any_yaml_document_is_an_inventory_or_an_error(document: Any, flow: bool | None) -> None:
    parses_or_refuses(dump(document, flow))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=inventory_documents(), flow=st.sampled_from([None, True, False]))
@example(document={**yaml.safe_load(VALID), "timeouts": {"step": math.nan}}, flow=None)
@example(
    document={**yaml.safe_load(VALID), "hosts": {"here": {"local": True, "memory": "9" * 400}}}, flow=None
)
@example(document={**yaml.safe_load(VALID), "run": {"temperature": 10**400}}, flow=None)
@example(document={**yaml.safe_load(VALID), "timeouts": {"ready": 10**400}}, flow=None)
def test_inventory_shaped_documents(document: Any, flow: bool | None) -> None:
    parses_or_refuses(dump(document, flow))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=tagged_texts())
@example(source=fill({"hosts.local": "!!bool maybe"}))
@example(source=fill({"model.path": "!!int abc"}))
@example(source=fill({"run.temperature": "!!float abc"}))
@example(source=fill({"model.path": "!!timestamp abc"}))
@example(source=fill({"model.path": "!custom abc"}))
@example(source=fill({"model.path": "!!python/name:os.system abc"}))
def test_tagged_scalars(source: str) -> None:
    parses_or_refuses(source)
