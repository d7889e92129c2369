"""The few ggml functions llama-cpp-python does not bind, loaded with ctypes.

Used to read a named tensor out of the compute graph (the residual stream of
a stage's last block) and to list the backend devices for the agent's Hello.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

from ggufpipe_agent.wire.protocol import Device

# enum ggml_backend_dev_type: CPU, GPU, IGPU (integrated, host memory), ACCEL (BLAS, AMX)
GGML_DEVICE_TYPE_GPU = 1
GGML_DEVICE_TYPE_IGPU = 2


def bind(library: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> Any:
    """``library``'s C function ``name``, typed."""
    function = getattr(library, name)
    function.argtypes = list(argtypes)
    function.restype = restype
    return function


class _Ggml:
    def __init__(self) -> None:
        import llama_cpp  # noqa: F401  (loads libllama and ggml with it)

        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        main = ctypes.CDLL(str(lib_dir / "libggml.so"), mode=ctypes.RTLD_GLOBAL)

        void_p, size_t, char_p = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        self.get_name = bind(base, "ggml_get_name", char_p, void_p)
        self.nbytes = bind(base, "ggml_nbytes", size_t, void_p)
        self.tensor_get = bind(base, "ggml_backend_tensor_get", None, void_p, void_p, size_t, size_t)

        self.dev_count = bind(main, "ggml_backend_dev_count", size_t)
        self.dev_get = bind(main, "ggml_backend_dev_get", void_p, size_t)
        self.dev_name = bind(base, "ggml_backend_dev_name", char_p, void_p)
        self.dev_description = bind(base, "ggml_backend_dev_description", char_p, void_p)
        size_p = ctypes.POINTER(size_t)
        self.dev_memory = bind(base, "ggml_backend_dev_memory", None, void_p, size_p, size_p)
        self.dev_type = bind(base, "ggml_backend_dev_type", ctypes.c_int, void_p)


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
