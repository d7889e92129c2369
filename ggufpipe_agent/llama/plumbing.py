"""llama.cpp's C side as the stage engine needs it, through ctypes: the
backend set up once per process (its log routed to ours), the buffer-type
overrides that keep routed experts in host RAM, how many positions a token
of a stage file takes, a context's parameters, and the shape of a stage
(what its batch holds and its steps return)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufpipe_agent.errors import EngineError
from ggufpipe_agent.llama.devices import bind
from ggufpipe_agent.wire.protocol import EngineOptions


@dataclass(frozen=True, slots=True)
class StageShape:
    """Where a stage sits in the pipeline."""

    first: bool
    last: bool
    block_count: int  # blocks in this stage file
    hidden: int


_backend_lock = threading.Lock()
_backend_ready = False
_LLAMA_LOG_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_llama_log = logging.getLogger("ggufpipe.llama")


def init_backend() -> None:
    """llama_backend_init once per process, with llama.cpp's log routed to ours."""
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return
        import llama_cpp

        @llama_cpp.llama_log_callback
        def forward(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            mapped = _LLAMA_LOG_LEVELS.get(level, logging.DEBUG)
            if _llama_log.isEnabledFor(mapped):
                _llama_log.log(mapped, "%s", text.decode("utf-8", errors="replace").rstrip())

        _log_callback = forward  # keep the ctypes thunk alive
        llama_cpp.llama_log_set(forward, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True


_log_callback: object = None


class BufferTypeOverride(ctypes.Structure):
    """llama.h's ``struct llama_model_tensor_buft_override``: the tensors whose
    names match ``pattern`` (``std::regex_search``) go to buffer type ``buft``."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@functools.cache
def _cpu_buffer_type() -> int:
    """``ggml_backend_cpu_buffer_type()`` (libggml-base): llama.cpp compares an
    override's buffer type with it to keep the CPU's repacking buffer types."""
    import llama_cpp

    library = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    base = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    buft = bind(base, "ggml_backend_cpu_buffer_type", ctypes.c_void_p)()
    if not buft:
        raise EngineError("ggml has no CPU buffer type")
    return int(buft)


def experts_in_ram_overrides() -> ctypes.Array[BufferTypeOverride]:
    """The NULL-terminated override list of llama.cpp's ``--cpu-moe``: every
    routed expert tensor (``EXPERTS_PATTERN``) in a CPU buffer. llama.cpp
    keeps the pointer: the caller keeps the array alive with the model."""
    from ggufpipe_agent.gguf.memory import EXPERTS_PATTERN

    overrides = (BufferTypeOverride * 2)()  # the second, all zero, ends the list
    overrides[0].pattern = EXPERTS_PATTERN.encode()
    overrides[0].buft = _cpu_buffer_type()
    return overrides


#: LLAMA_ROPE_TYPE_MROPE and _IMROPE: llama.cpp reads 4 positions per embedding.
MROPE_TYPES = (8, 40)


def positions_per_token(path: str) -> int:
    """Positions per token of a batch of embeddings for this stage file."""
    from ggufpipe_agent.gguf.architectures import positions_per_token as per_token
    from ggufpipe_agent.gguf.files import read_gguf_header

    header = read_gguf_header(path)
    return per_token(header.architecture, header.get)


def gpu_offload_supported() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def stage_threads(options: EngineOptions) -> int:
    """A stage's llama.cpp threads: ``threads``, or one per core when 0 (its
    decode then keeps only the cores other processes leave free: llama/threads.py)."""
    return options.threads or os.cpu_count() or 1


def context_params_for(lib: Any, options: EngineOptions, parallel: int) -> Any:
    """llama.cpp's context parameters for a stage of ``parallel`` slots."""
    threads = stage_threads(options)
    params = lib.llama_context_default_params()
    # Each slot its own KV stream of n_ctx positions (not one cache shared
    # by all): a sequence's cells are laid out as when it is alone.
    params.n_ctx = options.n_ctx * parallel
    params.n_batch = options.n_batch
    params.n_ubatch = options.n_ubatch
    params.n_seq_max = parallel
    params.kv_unified = False
    params.n_threads = threads
    params.n_threads_batch = threads
    params.no_perf = True
    # A full-size sliding-window cache (gemma3) never drops a position, so
    # a kept prefix is laid out cell for cell as a cold run lays it out.
    params.swa_full = True
    return params
