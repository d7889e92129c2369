"""The Hello an agent opens every session with: who it is, what it runs on
and how to reach its data socket."""

from __future__ import annotations

import contextlib
import os
import platform
import socket

from ggufpipe_agent import PROTOCOL_VERSION, __version__
from ggufpipe_agent.protocol import Hello


def _meminfo() -> tuple[int, int]:
    total = available = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key == "MemTotal":
                total = int(rest.split()[0]) * 1024
            elif key == "MemAvailable":
                available = int(rest.split()[0]) * 1024
    return total, available


def make_hello(data_endpoint: str, data_token: str) -> Hello:
    import llama_cpp

    from ggufpipe_agent.engine import gpu_offload_supported
    from ggufpipe_agent.ggml import list_devices

    devices = tuple(list_devices())
    backend = "cpu"
    if devices:
        backend = devices[0].name.rstrip("0123456789").lower() or "gpu"
    total, available = _meminfo()
    return Hello(
        protocol=PROTOCOL_VERSION,
        version=__version__,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        python=platform.python_version(),
        llama_cpp=getattr(llama_cpp, "__version__", ""),
        backend=backend,
        gpu_offload=gpu_offload_supported(),
        devices=devices,
        memory_total=total,
        memory_available=available,
        data_endpoint=data_endpoint,
        data_token=data_token,
    )
