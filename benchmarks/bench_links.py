"""Link benchmark: what one stage-to-stage link costs per object, by mechanism.

    .venv/bin/python benchmarks/bench_links.py [--round-trips 3000] [--repeats 5]

Two processes on this machine play producer and consumer of a direct stage
link; the producer sends an object record (a 44-byte header and the payload of
one decode step of SmolLM2: 576 float32 = 2304 bytes) and the consumer answers
with a token record (48 bytes), back and forth. Half a round trip is what one
link adds to each token (the write, the peer's wake-up, the read). Mechanisms:

* a Unix socket (stages on one host);
* TCP on loopback, no encryption (a reference: what TLS adds);
* mutual TLS 1.3 over TCP, with certificates from a per-session CA made with
  ``cryptography`` (what ggufpipe uses between hosts);
* an asyncssh server on the consumer with an ephemeral host key and one
  authorized client key, the object on a session channel (the alternative the
  issue suggested).

Both ends run the event loop the agents run (uvloop). Writes
docs/bench-links.md.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ggufpipe_agent import aio  # noqa: E402
from ggufpipe_agent.process.peer_links import client_context, server_context  # noqa: E402
from ggufpipe_tui.dataplane.credentials import LinkAuthority  # noqa: E402

ACTIVATION = 44 + 576 * 4
TOKEN = 48
MECHANISMS = ("unix socket", "tcp loopback", "mutual TLS 1.3", "asyncssh channel")


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The consumer: read one activation, answer one token, until EOF."""
    answer = struct.pack("<Q", 7) * (TOKEN // 8)
    try:
        while True:
            await reader.readexactly(ACTIVATION)
            writer.write(answer)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


def _consumer(mechanism: str, where: str, material: dict[str, bytes], ready: object) -> None:
    async def main() -> None:
        if mechanism == "unix socket":
            server = await asyncio.start_unix_server(_echo, path=where)
        elif mechanism == "tcp loopback":
            server = await asyncio.start_server(_echo, "127.0.0.1", int(where))
        elif mechanism == "mutual TLS 1.3":
            context = server_context(material["cert"], material["key"], material["ca"], Path(tempfile.mkdtemp()))
            server = await asyncio.start_server(_echo, "127.0.0.1", int(where), ssl=context)
        else:
            import asyncssh

            class Server(asyncssh.SSHServer):
                def begin_auth(self, username: str) -> bool:
                    return True

            async def process(proc: asyncssh.SSHServerProcess[bytes]) -> None:
                await _echo(proc.stdin, proc.stdout)  # type: ignore[arg-type]
                proc.exit(0)

            host_key = asyncssh.generate_private_key("ssh-ed25519")
            client = asyncssh.import_authorized_keys(material["ssh_public"].decode())
            server = await asyncssh.listen(
                "127.0.0.1",
                int(where),
                server_host_keys=[host_key],
                authorized_client_keys=client,
                server_factory=Server,
                process_factory=process,
                encoding=None,
            )
        ready.set()  # type: ignore[attr-defined]
        await asyncio.sleep(3600)
        server.close()

    aio.run(main())


async def _producer(mechanism: str, where: str, material: dict[str, bytes], trips: int) -> float:
    """Mean round trip in microseconds."""
    connection = None
    if mechanism == "unix socket":
        reader, writer = await asyncio.open_unix_connection(where)
    elif mechanism == "tcp loopback":
        reader, writer = await asyncio.open_connection("127.0.0.1", int(where))
    elif mechanism == "mutual TLS 1.3":
        context = client_context(material["cert"], material["key"], material["ca"], Path(tempfile.mkdtemp()))
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", int(where), ssl=context, server_hostname="stage-1.ggufpipe.invalid"
        )
    else:
        import asyncssh

        key = asyncssh.import_private_key(material["ssh_private"].decode())
        connection = await asyncssh.connect(
            "127.0.0.1", int(where), client_keys=[key], known_hosts=None, username="stage"
        )
        process = await connection.create_process(encoding=None)
        reader, writer = process.stdout, process.stdin  # type: ignore[assignment]
    payload = os.urandom(ACTIVATION)
    for _ in range(200):  # warm-up
        writer.write(payload)
        await reader.readexactly(TOKEN)
    started = time.perf_counter()
    for _ in range(trips):
        writer.write(payload)
        await writer.drain()
        await reader.readexactly(TOKEN)
    elapsed = time.perf_counter() - started
    writer.close()
    if connection is not None:
        connection.close()
    return elapsed / trips * 1e6


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure(mechanism: str, trips: int, consumer_material: dict[str, bytes], producer_material: dict[str, bytes]) -> float:
    where = os.path.join(tempfile.mkdtemp(), "link.sock") if mechanism == "unix socket" else str(_free_port())
    ready = multiprocessing.Event()
    consumer = multiprocessing.Process(
        target=_consumer, args=(mechanism, where, consumer_material, ready), daemon=True
    )
    consumer.start()
    try:
        if not ready.wait(30):
            raise RuntimeError(f"{mechanism}: the consumer did not start")
        return aio.run(_producer(mechanism, where, producer_material, trips))
    finally:
        consumer.terminate()
        consumer.join(5)


def credentials() -> tuple[dict[str, bytes], dict[str, bytes]]:
    """What the consumer (stage 1) and the producer (stage 0) hold."""
    import asyncssh

    authority = LinkAuthority()
    consumer, producer = authority.issue(1), authority.issue(0)
    ssh_key = asyncssh.generate_private_key("ssh-ed25519")
    return (
        {"ca": authority.certificate_pem, "cert": consumer.certificate, "key": consumer.key,
         "ssh_public": ssh_key.export_public_key()},
        {"ca": authority.certificate_pem, "cert": producer.certificate, "key": producer.key,
         "ssh_private": ssh_key.export_private_key()},
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-links.md")
    args = parser.parse_args()
    consumer, producer = credentials()
    samples: dict[str, list[float]] = {name: [] for name in MECHANISMS}
    for _ in range(args.repeats):  # interleaved: machine noise hits every mechanism alike
        for name in MECHANISMS:
            samples[name].append(measure(name, args.round_trips, consumer, producer))
    load = os.getloadavg()[0]
    lines = [
        f"Round trips of a {ACTIVATION}-byte activation record and a {TOKEN}-byte token record between two "
        f"processes on this machine, {args.round_trips} per sample, median of {args.repeats} interleaved "
        f"samples, {os.cpu_count()} cores ({platform.machine()}), Python {platform.python_version()}, uvloop "
        f"on both ends, load average {load:.1f} at the end. One link adds about half a round trip to each token.",
        "",
        "| mechanism | round trip µs (median) | min | max | per link per token µs |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in MECHANISMS:
        values = samples[name]
        middle = statistics.median(values)
        lines.append(f"| {name} | {middle:.1f} | {min(values):.1f} | {max(values):.1f} | {middle / 2:.1f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.write_text(
        "# Link benchmark\n\n"
        f"Measured {time.strftime('%Y-%m-%d')} with `python benchmarks/bench_links.py`.\n\n" + table
    )
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
