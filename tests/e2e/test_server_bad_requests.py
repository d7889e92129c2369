"""One bad request must not wedge or end the server (docs/security.md, "A misbehaving stage or orchestrator").

Each case is sent to a real ``--serve`` process (three local stages, real
llama.cpp) as an outside client would send it: the request gets a 4xx, and
afterwards the server answers a normal request with the same text as before,
``/health`` says ok, and the same agent processes are still there."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.common import agent_pids, wait_no_new_agents
from tests.support.local import UNEVEN, run_cli, write_inventory
from tests.support.served import KEY, Served, raw, start_server

pytestmark = [pytest.mark.model, pytest.mark.slow]

NORMAL = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> Iterator[tuple[Served, str, set[int]]]:
    before = agent_pids()
    served = start_server(tmp_path_factory.mktemp("server-bad"), model_path)
    try:
        status, body = raw(served, "POST", "/v1/completions", json=NORMAL)
        assert status == 200, body
        yield served, body["choices"][0]["text"], agent_pids() - before  # type: ignore[index]
    finally:
        code = served.stop()
        left = wait_no_new_agents(before)
    assert code == 0, "".join(served.lines)
    assert not left, f"agents left behind: {sorted(left)}"


def still_serving(served: Served, text: str, agents: set[int]) -> None:
    assert served.process.poll() is None, "".join(served.lines)
    status, body = raw(served, "GET", "/health", key=None)
    assert status == 200 and body["status"] == "ok", body
    status, body = raw(served, "POST", "/v1/completions", json=NORMAL)
    assert status == 200, body
    assert body["choices"][0]["text"] == text  # type: ignore[index]
    assert agents <= agent_pids(), "a stage's agent died"


def post_bytes(
    served: Served, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    return raw(
        served, "POST", path, data=body, headers={"Content-Type": "application/json", **(headers or {})}
    )


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x \udfff y", "max_tokens": 4}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a \ud800 b"}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stop": ["\udc00"]},
            "stop",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400(server, path: str, body: dict, param: str) -> None:
    served, text, agents = server
    status, answer = post_bytes(served, path, json.dumps(body).encode())  # ensure_ascii: "\udfff" escapes
    assert status == 400, answer
    assert answer["error"]["param"] == param and "lone surrogate" in answer["error"]["message"], answer
    still_serving(served, text, agents)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("top_p", "NaN"),
        ("top_k", "2147483648"),
        ("seed", "9223372036854775808"),
    ],
)
def test_a_sampling_value_a_stage_would_refuse_is_a_400(server, field: str, value: str) -> None:
    served, text, agents = server
    body = f'{{"prompt": "x", "max_tokens": 2, "{field}": {value}}}'.encode()
    status, answer = post_bytes(served, "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == field, answer
    still_serving(served, text, agents)


def test_a_large_chat_body_is_a_400_not_a_fault(server) -> None:
    served, text, agents = server
    words = "a " * (4 * 1024 * 1024 - 64)  # ~8 MB, accepted by the HTTP layer, millions of tokens
    body = json.dumps({"messages": [{"role": "user", "content": words}], "max_tokens": 4}).encode()
    assert len(body) < 8 * 1024 * 1024
    status, answer = post_bytes(served, "/v1/chat/completions", body)
    assert status == 400, answer
    assert "tokens" in answer["error"]["message"], answer
    still_serving(served, text, agents)


def test_more_messages_than_a_stage_takes_is_a_400(server) -> None:
    served, text, agents = server
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 65537}).encode()  # ~2 MB
    status, answer = post_bytes(served, "/v1/chat/completions", body)
    assert status == 400 and "at most 65536 messages" in answer["error"]["message"], answer
    still_serving(served, text, agents)


def test_token_ids_outside_the_vocabulary_are_a_400(server) -> None:
    served, text, agents = server
    status, answer = post_bytes(served, "/v1/completions", b'{"prompt": [1, 999999999], "max_tokens": 2}')
    assert status == 400 and "token id 999999999 is not in the vocabulary" in answer["error"]["message"], (
        answer
    )
    still_serving(served, text, agents)


def test_an_integer_of_thousands_of_digits_is_a_400(server) -> None:
    served, text, agents = server
    status, answer = post_bytes(
        served, "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}"
    )
    assert status == 400 and "not JSON" in answer["error"]["message"], answer
    still_serving(served, text, agents)


def test_a_deeply_nested_body_is_a_400(server) -> None:
    served, text, agents = server
    status, answer = post_bytes(served, "/v1/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400, answer
    still_serving(served, text, agents)


def test_an_authorization_header_that_is_not_utf8_is_a_401(server) -> None:
    served, text, agents = server
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer \xff\xfe\xfd\r\nContent-Length: 13\r\nConnection: close\r\n\r\n"
        b'{"prompt":""}'
    )
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401"), reply[:300]
    assert json.loads(payload)["error"]["code"] == "invalid_api_key"
    assert b"Traceback" not in reply
    still_serving(served, text, agents)


def test_idle_connections_are_closed(server) -> None:
    from ggufpipe_tui.server.http import IDLE_SECONDS

    served, text, agents = server
    silent = [socket.create_connection(("127.0.0.1", served.port), timeout=5) for _ in range(64)]
    slow = socket.create_connection(("127.0.0.1", served.port), timeout=5)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    try:
        still_serving(served, text, agents)  # served meanwhile
        deadline = time.monotonic() + IDLE_SECONDS + 10
        for sock in [*silent, slow]:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            assert sock.recv(1024) == b"", "the server closes an idle connection"
    finally:
        for sock in [*silent, slow]:
            sock.close()
    still_serving(served, text, agents)


def test_headless_refuses_a_prompt_that_is_not_utf8(tmp_path: Path, model_path: Path) -> None:
    inventory = write_inventory(tmp_path, model_path, UNEVEN)
    import subprocess
    import sys

    from tests.support.common import REPO

    done = subprocess.run(
        [
            sys.executable.encode(),
            b"-m",
            b"ggufpipe_tui.cli",
            str(inventory).encode(),
            b"--prompt",
            b"bad \xff\xfe bytes",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "ggufpipe: error: --prompt: byte 0xff at character 4 is not UTF-8", (
        done.stderr
    )
    (tmp_path / "bad.txt").write_bytes(b"bad \xff bytes")
    done = run_cli(str(inventory), "--prompt-file", str(tmp_path / "bad.txt"))
    assert done.returncode == 2 and done.stderr.strip().endswith("is not UTF-8 (byte 4)"), done.stderr
    done = run_cli(str(inventory), "--prompt-file", str(tmp_path / "missing.txt"))
    assert done.returncode == 2 and "--prompt-file" in done.stderr and "cannot read" in done.stderr, (
        done.stderr
    )


def test_a_prompt_from_stdin_or_a_file_runs_like_prompt(
    tmp_path: Path, model_path: Path, no_agent_left
) -> None:
    import subprocess
    import sys

    from tests.support.common import REPO

    inventory = write_inventory(tmp_path, model_path, UNEVEN, "max_tokens: 6, chat: false")
    prompt = "Secret plans for the weekend:"
    given = run_cli(str(inventory), "--prompt", prompt, "--json", "-q")
    assert given.returncode == 0, given.stderr
    (tmp_path / "prompt.txt").write_text(prompt)
    from_file = run_cli(str(inventory), "--prompt-file", str(tmp_path / "prompt.txt"), "--json", "-q")
    from_stdin = subprocess.run(
        [sys.executable, "-m", "ggufpipe_tui.cli", str(inventory), "--prompt", "-", "--json", "-q"],
        input=prompt,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    for done in (from_file, from_stdin):
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["tokens"] == json.loads(given.stdout)["tokens"]


def test_the_key_still_guards_the_api(server) -> None:
    served, _, _ = server
    assert raw(served, "POST", "/v1/completions", key="wrong", json=NORMAL)[0] == 401
    assert raw(served, "POST", "/v1/completions", key=KEY, json=NORMAL)[0] == 200


LONG_PROMPT = "word " * 600  # past the 512-token context with its max_tokens: refused by the run
REFUSALS: list[tuple[str, str, bytes, dict[str, str], int]] = [
    ("POST", "/v1/chat/completions", b"{not json", {}, 400),
    ("POST", "/v1/chat/completions", b'{"messages": [], "bogus": 1}', {}, 400),
    ("POST", "/v1/completions", json.dumps({"prompt": LONG_PROMPT, "max_tokens": 8}).encode(), {}, 400),
    (
        "POST",
        "/v1/chat/completions",
        json.dumps(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            }
        ).encode(),
        {},
        400,
    ),
    ("POST", "/v1/messages", b'{"max_tokens": 4}', {}, 400),
    ("POST", "/v1/responses", b'{"input": 5}', {}, 400),
    ("POST", "/v1/chat/completions", b"{}", {"Authorization": "Bearer wrong"}, 401),
    ("POST", "/tokenize", b'{"content": "a"}', {"Authorization": "Bearer wrong"}, 401),
    ("GET", "/v1/nowhere", b"", {}, 404),
    ("GET", "/v1/chat/completions", b"", {}, 405),
    ("POST", "/v1/completions", b"x" * (9 * 1024 * 1024), {}, 413),
]


def test_each_refusal_is_logged_once(server) -> None:
    """A refused request has one log line with its status, whoever refused
    it (the key check, a parser, the router, the run that cannot fit)."""
    served, text, agents = server
    for method, path, body, headers, expected in REFUSALS:
        served.settle()  # the line of the request before this one is in
        before = len(served.lines)
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers}
        status, answer = raw(served, method, path, key=None, data=body, headers=headers)
        assert status == expected, (path, answer)
        served.settle()  # the reader thread has the line
        lines = served.lines[before:]
        assert len(lines) == 1, (path, lines)
        assert f" {method} {path} {expected}" in lines[0], lines
    still_serving(served, text, agents)


def test_a_client_gone_mid_reply_is_logged_with_what_it_was_sent(server) -> None:
    served, text, agents = server
    before = len(served.lines)
    stream = served.client().chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Repeat the word hello 5000 times."}],
        max_tokens=200,
        stream=True,
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 6:
            break
    stream.close()  # goes away mid-reply
    line = served.wait_line(lambda line: " 499 " in line, 30, "the line of the request gone")
    assert len([line for line in served.lines[before:] if "POST /v1/chat/completions" in line]) == 1
    completion = int(line.split("completion ")[1].split()[0])
    assert completion >= 6 and "prompt 0 tokens" not in line, line
    still_serving(served, text, agents)
