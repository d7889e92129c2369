"""``ggufpipe-tui``: the orchestrator's command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ggufpipe_agent import __version__
from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.wire.codec import text_problem
from ggufpipe_tui.commands.parsing import inventory_parser

DESCRIPTION = """\
Pipeline-parallel LLM inference from one GGUF model across several hosts.
Reads INVENTORY (model, hosts, stages), starts one ggufpipe-agent per stage
(as a local process or over SSH), loads each stage's layer range with
llama.cpp, and streams the generated text.

Without --prompt it opens the terminal UI; with --prompt (or --prompt-file) it
runs headless; with --serve HOST:PORT it serves the OpenAI API (chat
completions and completions, streamed or not; several requests in flight at
once, each in its own slot of every stage: --parallel) until SIGTERM; with
--plan it prints the plan (each stage's layers and the memory it needs and
has on its host) and exits without loading anything.

An SSH host whose entry names no agent: gets this orchestrator's agent on the
first run (a venv of its own there, its wheels pushed over SSH or built there
from the host's own index). ggufpipe-tui setup INVENTORY does that for every
host ahead of time; with --check it only reports what each host has (Python,
platform, GPUs, the agent, free disk; see ggufpipe-tui setup --help).

ggufpipe-tui cache INVENTORY [list | remove NAME... | remove --all | verify]
lists, removes or verifies the stage files cached on the inventory's hosts
(see ggufpipe-tui cache --help).

The model reaches the hosts in one of three ways: each host holds its own
copy at model.path (the default; every copy is checked to be stage 0's
model before anything loads), a shared file system gives every host the
same path, or model: {path: P, send: true} reads P on this machine and sends
each host only its stage file over its SSH connection (cached there, checked
by digest, resumed after an interruption, nothing sent when it is there).

Stages without layers in the inventory are split by memory: each gets blocks
in proportion to the room its host has after the stage's fixed parts. A plan
that does not fit is refused before any stage loads, saying what would fit.
A host's memory: key caps the RAM the plan may use there (12GiB, 16GB,
512MiB or bytes; stages on one host share it). See docs/planning.md."""

EPILOG = """\
in the UI: Enter runs the prompt (the next turn of the conversation), esc stops
the generation (it keeps what it has), ctrl+n starts a new conversation, ctrl+f
filters the log by stage, ctrl+r starts the pipeline again, ctrl+q stops every
stage and quits.

--serve: OpenAI's POST /v1/chat/completions, /v1/completions, /v1/responses
and GET /v1/models, Anthropic's POST /v1/messages (and /count_tokens), GET
/health on HOST:PORT (127.0.0.1 unless told otherwise; port 0 picks one), and
llama-server's POST /tokenize, POST /detokenize, GET /props, GET /slots and
GET /metrics (Prometheus' text format); --parallel requests run at once, each
in its slot, the others wait in order. SIGTERM lets the running requests
finish for a while, then stops them (a reply cut short ends with an error
naming the shutdown, or a 503), tears every stage down and exits 0; a fault
of the pipeline exits 1.

exit status (headless): 0 the run completed, 1 the run faulted (the output so
far is printed, the reason is the last line on stderr), 2 the pipeline could
not be set up (bad inventory, unreachable host, missing model, a plan that
does not fit in memory, ...). --plan: 0 the plan fits, 2 it does not (the
plan is printed all the same) or could not be made.

Each run writes a JSON Lines event log; its path is printed at the end
(directory: --log-dir, $GGUFPIPE_LOG_DIR or ~/.local/state/ggufpipe/runs)."""


def build_parser() -> argparse.ArgumentParser:
    parser = inventory_parser("ggufpipe-tui", DESCRIPTION, EPILOG)
    parser.add_argument(
        "--prompt",
        metavar="TEXT",
        help="run this prompt headless and exit ('-': read it from standard input, so that it is "
        "not visible in ps)",
    )
    parser.add_argument(
        "--prompt-file", metavar="PATH", help="run the prompt in this UTF-8 file headless and exit"
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the plan (stages, hosts, layers, memory needed / available) and exit; "
        "connects the agents and reads the model, loads nothing",
    )
    serve = parser.add_argument_group("server")
    serve.add_argument(
        "--serve", metavar="HOST:PORT", help="serve the OpenAI API on HOST:PORT (e.g. 127.0.0.1:8080)"
    )
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("GGUFPIPE_API_KEY", ""),
        help="require 'Authorization: Bearer KEY' (default: $GGUFPIPE_API_KEY; none: no key)",
    )
    serve.add_argument(
        "--queue",
        type=int,
        default=16,
        metavar="N",
        help="waiting requests allowed behind the running ones (16)",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (e.g. http://localhost:5173; repeatable; '*': any) call the "
        "server, preflights answered; off by default, since otherwise a page from any site the browser "
        "opens could drive a server that has no API key, e.g. one on localhost",
    )
    serve.add_argument(
        "--chat-template-file",
        metavar="PATH",
        help="render conversations with the Jinja chat template in PATH instead of the model's own "
        "(as llama-server's option): a template that knows tools, for a model whose own does not",
    )
    serve.add_argument(
        "--parallel",
        type=int,
        metavar="K",
        help="requests in flight at once, each in its own slot of every stage (default: the "
        "inventory's run.parallel, else one per machine the stages run on, and one per stage "
        "on this machine where each has threads: of its own); with --plan: the memory of K slots",
    )
    group = parser.add_argument_group("run options (override the inventory's run: section)")
    group.add_argument("--max-tokens", type=int, metavar="N", help="stop after N generated tokens")
    group.add_argument("--temperature", type=float, metavar="T", help="0 is greedy (the default)")
    group.add_argument("--top-k", type=int, metavar="K", help="top-k when sampling (temperature > 0)")
    group.add_argument("--top-p", type=float, metavar="P", help="top-p when sampling (temperature > 0)")
    group.add_argument("--seed", type=int, metavar="S", help="seed of the sampler's draw")
    group.add_argument("--context", type=int, metavar="N", help="context size in tokens")
    group.add_argument(
        "--activation-dtype",
        choices=("float32", "float16"),
        help="activations between stages: float32 (exact) or float16 (half the bytes)",
    )
    group.add_argument(
        "--ignore-eos", action="store_true", default=None, help="generate max_tokens even past EOS"
    )
    group.add_argument(
        "--raw", action="store_true", help="send the prompt as is, not through the model's chat template"
    )
    group.add_argument(
        "--feedback",
        choices=("ring", "orchestrator"),
        help="who feeds each token back to stage 0: the last stage directly (ring, the default) "
        "or the orchestrator",
    )
    group.add_argument(
        "--data",
        choices=("auto", "direct", "relay"),
        help="how activations move between stages on every host: direct links where they can be "
        "set up (auto, the default), direct links or fail (direct), or through the orchestrator (relay)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with tokens, text and timings at the end (with --plan: the plan, "
        "each stage's layers as [start, end])",
    )
    out.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    out.add_argument(
        "-v", "--verbose", action="store_true", help="agent logs and every state change on stderr"
    )
    out.add_argument(
        "--log-dir", metavar="DIR", help="where run event logs go (0600 each; the newest 256 are kept)"
    )
    parser.add_argument("--version", action="version", version=f"ggufpipe {__version__}")
    return parser


def read_prompt(path: str | None) -> str:
    """A prompt from a file, or standard input when ``path`` is None, as UTF-8."""
    where = path or "standard input"
    try:
        data = Path(path).read_bytes() if path else sys.stdin.buffer.read()
    except OSError as error:
        raise GgufpipeError(f"--prompt-file {path}: cannot read ({error.strerror or error})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise GgufpipeError(f"the prompt in {where} is not UTF-8 (byte {error.start})") from None


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["setup"]:
        from ggufpipe_tui.commands.setup import setup_main

        return setup_main(given[1:])
    if given[:1] == ["cache"]:
        from ggufpipe_tui.commands.cache import cache_main

        return cache_main(given[1:])
    parser = build_parser()
    args = parser.parse_args(given)
    if args.prompt is not None and args.prompt_file is not None:
        parser.error("--prompt and --prompt-file: one or the other")
    if args.prompt_file is not None or args.prompt == "-":
        try:
            args.prompt = read_prompt(args.prompt_file)
        except GgufpipeError as error:
            print(f"ggufpipe: error: {error}", file=sys.stderr)
            return 2
    if args.serve is not None and args.prompt is not None:
        parser.error("--serve and --prompt: one or the other")
    if args.prompt is not None and (problem := text_problem(args.prompt)):
        print(f"ggufpipe: error: --prompt: {problem}", file=sys.stderr)
        return 2
    if args.chat_template_file and args.serve is None:
        parser.error("--chat-template-file: only with --serve")
    if args.cors_origin and args.serve is None:
        parser.error("--cors-origin: only with --serve")
    if bad := [origin for origin in args.cors_origin if origin != "*" and "://" not in origin]:
        parser.error(f"--cors-origin {bad[0]!r}: an origin is SCHEME://HOST[:PORT] (or '*')")
    if args.queue < 0:
        parser.error("--queue: must not be negative")
    if args.parallel is not None and args.serve is None and not args.plan:
        parser.error("--parallel: only with --serve or --plan (a conversation runs one turn at a time)")
    logging.basicConfig(level=logging.WARNING if not args.verbose else logging.INFO, stream=sys.stderr)
    from ggufpipe_tui.core.inventory import load_inventory, with_data_mode, with_run_options
    from ggufpipe_tui.core.inventory_policy import default_parallel

    try:
        inventory = load_inventory(args.inventory)
        inventory = with_run_options(
            inventory,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            context=args.context,
            activation_dtype=args.activation_dtype,
            ignore_eos=args.ignore_eos,
            chat=False if args.raw else None,
            feedback=args.feedback,
        )
        inventory = with_data_mode(inventory, args.data)
        if args.serve is not None:
            # By default one run in flight per machine: each machine busy.
            cores = os.cpu_count() or 1
            parallel = args.parallel or inventory.run.parallel or default_parallel(inventory, cores)
        elif args.plan:  # the memory of that many slots
            parallel = args.parallel or inventory.run.parallel or 1
        else:
            parallel = 1  # one prompt, or a conversation's turns, one at a time
        inventory = with_run_options(inventory, parallel=parallel)
    except GgufpipeError as error:
        print(f"ggufpipe: error: {error}", file=sys.stderr)
        return 2
    # What every front end without a screen takes from the command line.
    printing: dict[str, Any] = {"verbose": args.verbose, "quiet": args.quiet, "log_dir": args.log_dir}
    if args.plan:
        from ggufpipe_agent import aio
        from ggufpipe_tui.commands.plan import run_plan

        return aio.run(run_plan(inventory, as_json=args.json, **printing))
    if args.prompt is not None:
        from ggufpipe_agent import aio
        from ggufpipe_tui.commands.headless import run_headless

        return aio.run(run_headless(inventory, args.prompt, as_json=args.json, **printing))
    if args.serve is not None:
        from ggufpipe_agent import aio
        from ggufpipe_tui.server.serve import run_server

        cors = args.cors_origin
        template = ""
        if args.chat_template_file:
            try:
                template = Path(args.chat_template_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                parser.error(f"--chat-template-file {args.chat_template_file}: {error}")
        serving = run_server(
            inventory,
            args.serve,
            api_key=args.api_key,
            queue=args.queue,
            cors_origins=cors,
            chat_template=template,
            **printing,
        )
        return aio.run(serving)
    from ggufpipe_tui.views.app import run_app

    return run_app(inventory, log_dir=args.log_dir)


if __name__ == "__main__":
    sys.exit(main())
