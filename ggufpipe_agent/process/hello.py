"""The Hello an agent opens every session with: who it is, what it runs on
and how to reach its data socket."""

from __future__ import annotations

import os
import platform
import socket

from ggufpipe_agent import PROTOCOL_VERSION, __version__
from ggufpipe_agent.wire.protocol import Hello


def make_hello(data_endpoint: str, data_token: str, share_endpoint: str = "", share_token: str = "") -> Hello:
    import llama_cpp

    from ggufpipe_agent.llama.devices import list_devices
    from ggufpipe_agent.llama.plumbing import gpu_offload_supported
    from ggufpipe_agent.process.host_memory import system_memory

    devices = tuple(list_devices())
    backend = "cpu"
    if devices:
        backend = devices[0].name.rstrip("0123456789").lower() or "gpu"
    total, available = system_memory()  # bounded by a container's cgroup limit
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
        share_endpoint=share_endpoint,
        share_token=share_token,
    )
