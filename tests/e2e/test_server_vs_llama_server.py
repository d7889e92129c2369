"""``--serve`` side by side with llama.cpp's own llama-server on the same
model: the same request to both, the same answer back.

llama-server is the one ``scripts/build-llama-server`` builds, from exactly
the llama.cpp our llama-cpp-python vendors (same kernels, same samplers); it
runs ``-t 1 -c 2048 --parallel 1`` with its Jinja chat templates (its
default), ggufpipe over two local stages of one thread each. Compared, on
/v1/chat/completions and /v1/completions: greedy text under a JSON schema
(OpenAI's ``response_format`` and llama-server's own ``json_schema`` and
``grammar``), logprobs (the same tokens, values within 1e-3, the same
alternatives), a seeded sampled reply, and plain greedy text. Every request
says ``cache_prompt: false``: neither side keeps an earlier request's
prefix, so no answer depends on the one before.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ggufpipe_tui.server.json_grammar import chat_form, unwrap_chat_form
from ggufpipe_tui.server.sampling import schema_grammar
from tests.support.common import agent_pids, serve, wait_no_new_agents
from tests.support.local import write_inventory
from tests.support.served import KEY, START_TIMEOUT, Served

pytestmark = [pytest.mark.model, pytest.mark.slow]

#: Where scripts/build-llama-server puts it.
LLAMA_SERVER = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ggufpipe" / "llama-server"
TWO_STAGES = "- {host: a, layers: [0, 15]}\n- {host: b, layers: [15, 30]}\n"
HOSTS = "  a: {local: true, threads: 1}\n  b: {local: true, threads: 1}\n"
TOLERANCE = 1e-3
#: SmolLM2's control tokens, which llama-server's logprobs show as "".
SPECIAL = {"<|im_end|>", "<|im_start|>", "<|endoftext|>"}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK_PERSON = "Describe a made-up person as JSON with their name, age and city."
PROMPTS = [
    "What is the capital of France? Answer in one short sentence.",
    "Write a haiku about the sea.",
]


def post(url: str, path: str, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        url + path,
        data=json.dumps({"cache_prompt": False, **body}).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return json.loads(answer.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as error:
        raise AssertionError(f"{url}{path}: {error.code} {error.read().decode()[:2000]}") from None


class Pair:
    """The two servers: ``ask`` sends one body to both and gives both answers."""

    def __init__(self, ours: Served, theirs: str) -> None:
        self.ours, self.theirs = ours, theirs

    def ask(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        return post(self.ours.url, path, body, KEY), post(self.theirs, path, body)


def start_llama_server(model: Path, port_file: Path) -> tuple[subprocess.Popen[bytes], str]:
    """llama-server on a free port (it picks none itself: we try a few)."""
    log = port_file.open("wb")
    for port in range(18600 + os.getpid() % 200, 18900):
        process = subprocess.Popen(
            [str(LLAMA_SERVER), "-m", str(model), "-t", "1", "-c", "2048", "--parallel", "1",
             "--host", "127.0.0.1", "--port", str(port), "--no-webui"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                    if json.loads(answer.read()).get("status") == "ok":
                        return process, url
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        if process.poll() is None:
            process.kill()
            process.wait()
            break
        if "bind" not in port_file.read_text(errors="replace").lower():
            break  # not a port in use: it will not start on another
    raise AssertionError("llama-server did not start:\n" + port_file.read_text(errors="replace")[-4000:])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[Pair]:
    if not LLAMA_SERVER.is_file():
        pytest.skip(f"llama-server is not built ({LLAMA_SERVER}): run scripts/build-llama-server")
    tmp = tmp_path_factory.mktemp("vs-llama-server")
    theirs, url = start_llama_server(model_path, tmp / "llama-server.log")
    before = agent_pids()
    served: Served | None = None
    try:
        inventory = write_inventory(
            tmp, model_path, TWO_STAGES, hosts=HOSTS, here="{local: true}", context=2048, ubatch=512
        )
        process, lines = serve(inventory, tmp / "runs")
        served = Served(process, 0, tmp / "runs", inventory, lines)
        listening = served.wait_line(lambda line: "listening on http://" in line, 60, "the listening line")
        served.port = int(re.search(r"127\.0\.0\.1:(\d+)/v1", listening).group(1))  # type: ignore[union-attr]
        served.wait_line(lambda line: line.startswith("ggufpipe: ready:"), START_TIMEOUT, "the stages")
        yield Pair(served, url)
    finally:
        theirs.terminate()
        theirs.wait(30)
        if served is not None:
            code = served.stop()
            assert code == 0, "".join(served.lines)
        left = wait_no_new_agents(before)
        assert not left, f"agents left behind: {sorted(left)}"


def chat_text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["message"]["content"])


def completion_text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["text"])


def same_finish(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]


# ------------------------------------------------------------------ greedy


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chat_equal(pair: Pair, prompt: str) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 32, "temperature": 0}
    ours, theirs = pair.ask("/v1/chat/completions", body)
    assert chat_text(ours) == chat_text(theirs)
    same_finish(ours, theirs)
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    # llama-server counts the end-of-generation token it stopped at; ggufpipe counts the reply's.
    stopped = ours["choices"][0]["finish_reason"] == "stop"
    assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"] - stopped


def test_greedy_completion_equal(pair: Pair) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}
    ours, theirs = pair.ask("/v1/completions", body)
    assert completion_text(ours) == completion_text(theirs)
    same_finish(ours, theirs)


# --------------------------------------------------------- structured output


def person_chat(**extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": ASK_PERSON}],
        "max_tokens": 96,
        "temperature": 0,
        **extra,
    }


#: llama-server's chat path (its Jinja templates' "peg-native" format) holds the
#: reply to ``space ("```json" space SCHEMA space "```" | space SCHEMA space)`` and
#: gives the JSON inside as the content: SmolLM2 writes the fence, and the JSON
#: in it, after "```json\n", differs from what it writes held to SCHEMA alone.
#: ggufpipe's chat path holds the reply to the same form and unwraps it as it
#: streams (server/json_grammar.py), so the chat answers below are equal.


@pytest.mark.parametrize(
    "form",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "strict": True, "schema": PERSON},
            }
        },
        {"json_schema": PERSON},
        {"response_format": {"type": "json_object"}},
    ],
    ids=["response_format", "strict", "llama_json_schema", "json_object"],
)
def test_greedy_chat_under_schema_equal(pair: Pair, form: dict[str, Any]) -> None:
    ours, theirs = pair.ask("/v1/chat/completions", person_chat(**form))
    assert chat_text(ours) == chat_text(theirs)
    same_finish(ours, theirs)
    if ours["choices"][0]["finish_reason"] == "stop":
        value = json.loads(chat_text(ours))
        if "json_object" not in json.dumps(form):
            assert set(value) == {"name", "age", "city"} and isinstance(value["age"], int)


def test_greedy_completion_under_schema_and_grammar_equal(pair: Pair) -> None:
    prompt = f"{ASK_PERSON}\nJSON:"
    ours, theirs = pair.ask(
        "/v1/completions", {"prompt": prompt, "max_tokens": 96, "temperature": 0, "json_schema": PERSON}
    )
    assert completion_text(ours) == completion_text(theirs)
    same_finish(ours, theirs)
    grammar = 'root ::= answer "."\nanswer ::= "yes" | "no" | "maybe, " [a-z ]+'
    ours, theirs = pair.ask(
        "/v1/completions",
        {"prompt": "Is the sea blue? Answer:", "max_tokens": 24, "temperature": 0, "grammar": grammar},
    )
    assert completion_text(ours) == completion_text(theirs)
    same_finish(ours, theirs)


# ------------------------------------------------------------------ logprobs


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE


def test_chat_logprobs_equal(pair: Pair) -> None:
    body = {
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    ours, theirs = pair.ask("/v1/chat/completions", body)
    assert chat_text(ours) == chat_text(theirs)
    mine, other = ours["choices"][0]["logprobs"]["content"], theirs["choices"][0]["logprobs"]["content"]
    if ours["choices"][0]["finish_reason"] == "stop":
        # llama-server gives the end-of-generation token it stopped at a record too (token "").
        assert other[-1]["token"] == "" and len(other) == len(mine) + 1
        other = other[:-1]
    assert [e["token"] for e in mine] == [e["token"] for e in other]
    assert [e["bytes"] for e in mine] == [e["bytes"] for e in other]
    for at, (a, b) in enumerate(zip(mine, other, strict=True)):
        assert close(a["logprob"], b["logprob"]), (at, a["token"], a["logprob"], b["logprob"])
        assert len(a["top_logprobs"]) == len(b["top_logprobs"]) == 5
        for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
            if y["token"] == "" and x["token"] in SPECIAL:
                # llama-server renders a control token as "" (its --special is off); ours by name.
                continue
            assert (x["token"], x["bytes"]) == (y["token"], y["bytes"]), at
            assert close(x["logprob"], y["logprob"]), (at, x, y)
            if "id" in x:  # llama-server's extension: the token's id
                assert x["id"] == y["id"]


def test_completion_logprobs_equal(pair: Pair) -> None:
    """Ours in OpenAI's legacy shape; llama-server answers in its chat shape."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "logprobs": 3}
    ours, theirs = pair.ask("/v1/completions", body)
    assert completion_text(ours) == completion_text(theirs)
    legacy, other = ours["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"]["content"]
    if ours["choices"][0]["finish_reason"] == "stop":
        other = other[:-1]  # llama-server's record of the end-of-generation token
    assert legacy["tokens"] == [e["token"] for e in other]
    for at, (value, entry) in enumerate(zip(legacy["token_logprobs"], other, strict=True)):
        assert close(value, entry["logprob"]), (at, value, entry["logprob"])
    for at, (top, entry) in enumerate(zip(legacy["top_logprobs"], other, strict=True)):
        theirs_top = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
        assert list(top) == list(theirs_top), at
        assert all(close(top[t], theirs_top[t]) for t in top), (at, top, theirs_top)
    text, offset = completion_text(ours), 0
    for token, at in zip(legacy["tokens"], legacy["text_offset"], strict=True):
        assert at == offset and text[at : at + len(token)] == token
        offset += len(token)


# ------------------------------------------------------------------ sampled


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.8, "seed": 42},
        {"temperature": 0.8, "seed": 42, "top_k": 20, "top_p": 0.9, "min_p": 0.1, "repeat_penalty": 1.1},
        {"temperature": 1.0, "seed": 7, "presence_penalty": 0.5, "frequency_penalty": 0.3, "typical_p": 0.9},
        {"temperature": 0.9, "seed": 3, "dry_multiplier": 0.8, "xtc_probability": 0.5, "xtc_threshold": 0.1},
        {"temperature": 0.8, "seed": 5, "mirostat": 2},
    ],
    ids=["seed", "top_k_p_min_p_repeat", "penalties_typical", "dry_xtc", "mirostat2"],
)
def test_seeded_sampled_chat_equal(pair: Pair, sampling: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 32, **sampling}
    ours, theirs = pair.ask("/v1/chat/completions", body)
    assert chat_text(ours) == chat_text(theirs)
    same_finish(ours, theirs)


def test_seeded_sampled_completion_equal(pair: Pair) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.8, "seed": 42}
    ours, theirs = pair.ask("/v1/completions", body)
    assert completion_text(ours) == completion_text(theirs)


def test_seeded_sampled_under_schema_equal(pair: Pair) -> None:
    """The grammar's rejection sampling draws as llama-server's does."""
    prompt = f"{ASK_PERSON}\nJSON:"
    for seed in (42, 7):
        body = {"prompt": prompt, "max_tokens": 96, "temperature": 0.8, "seed": seed, "json_schema": PERSON}
        ours, theirs = pair.ask("/v1/completions", body)
        assert completion_text(ours) == completion_text(theirs), seed


def test_seeded_sampled_chat_under_schema_equal(pair: Pair) -> None:
    ours, theirs = pair.ask("/v1/chat/completions", person_chat(json_schema=PERSON, temperature=0.8, seed=42))
    assert chat_text(ours) == chat_text(theirs)


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 42}], ids=["greedy", "seeded"]
)
def test_chat_form_gives_llama_servers_chat_reply(pair: Pair, sampling: dict[str, Any]) -> None:
    """json_grammar.chat_form and unwrap_chat_form are llama-server's chat
    path under a schema: its prompt (its /apply-template) as a completion
    held to our chat form, unwrapped, is its chat reply."""
    chat = person_chat(json_schema=PERSON, **sampling)
    prompt = post(pair.theirs, "/apply-template", {"messages": chat["messages"]})["prompt"]
    grammar = chat_form(schema_grammar(PERSON, "json_schema"))
    body = {"prompt": prompt, "grammar": grammar, "max_tokens": chat["max_tokens"], **sampling}
    ours = post(pair.ours.url, "/v1/completions", body, KEY)
    theirs = post(pair.theirs, "/v1/chat/completions", chat)
    assert unwrap_chat_form(completion_text(ours)) == chat_text(theirs)
