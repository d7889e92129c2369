"""The few ggml functions llama-cpp-python does not bind, loaded with ctypes.

Used to read a named tensor out of the compute graph (the residual stream of
a stage's last block) and to list the backend devices for the agent's Hello.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from ggufpipe_agent.wire.protocol import Device

# enum ggml_backend_dev_type: CPU, GPU, IGPU (integrated, host memory), ACCEL (BLAS, AMX)
GGML_DEVICE_TYPE_GPU = 1
GGML_DEVICE_TYPE_IGPU = 2


class _Ggml:
    def __init__(self) -> None:
        import llama_cpp  # noqa: F401  (loads libllama and ggml with it)

        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        main = ctypes.CDLL(str(lib_dir / "libggml.so"), mode=ctypes.RTLD_GLOBAL)

        self.get_name = base.ggml_get_name
        self.get_name.argtypes = [ctypes.c_void_p]
        self.get_name.restype = ctypes.c_char_p
        self.nbytes = base.ggml_nbytes
        self.nbytes.argtypes = [ctypes.c_void_p]
        self.nbytes.restype = ctypes.c_size_t
        self.tensor_get = base.ggml_backend_tensor_get
        self.tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.tensor_get.restype = None

        self.dev_count = main.ggml_backend_dev_count
        self.dev_count.argtypes = []
        self.dev_count.restype = ctypes.c_size_t
        self.dev_get = main.ggml_backend_dev_get
        self.dev_get.argtypes = [ctypes.c_size_t]
        self.dev_get.restype = ctypes.c_void_p
        self.dev_name = base.ggml_backend_dev_name
        self.dev_name.argtypes = [ctypes.c_void_p]
        self.dev_name.restype = ctypes.c_char_p
        self.dev_description = base.ggml_backend_dev_description
        self.dev_description.argtypes = [ctypes.c_void_p]
        self.dev_description.restype = ctypes.c_char_p
        self.dev_memory = base.ggml_backend_dev_memory
        self.dev_memory.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        self.dev_memory.restype = None
        self.dev_type = base.ggml_backend_dev_type
        self.dev_type.argtypes = [ctypes.c_void_p]
        self.dev_type.restype = ctypes.c_int


@functools.cache
def ggml() -> _Ggml:
    return _Ggml()


def list_devices() -> list[Device]:
    """The devices llama.cpp offloads layers to, with their memory: every GPU,
    or the integrated GPUs when there is none (llama_model_load's choice; the
    CPU and accelerators such as BLAS hold no layers)."""
    lib = ggml()
    found: dict[int, list[Device]] = {GGML_DEVICE_TYPE_GPU: [], GGML_DEVICE_TYPE_IGPU: []}
    for index in range(lib.dev_count()):
        dev = lib.dev_get(index)
        kind = lib.dev_type(dev)
        if kind not in found:
            continue
        free = ctypes.c_size_t(0)
        total = ctypes.c_size_t(0)
        lib.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        found[kind].append(
            Device(
                name=(lib.dev_name(dev) or b"").decode(errors="replace"),
                description=(lib.dev_description(dev) or b"").decode(errors="replace"),
                memory_total=int(total.value),
                memory_free=int(free.value),
            )
        )
    return found[GGML_DEVICE_TYPE_GPU] or found[GGML_DEVICE_TYPE_IGPU]
