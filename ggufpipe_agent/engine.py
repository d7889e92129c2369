"""The stage engine (the GPU worker): one layer range of a model in llama.cpp.

A stage file (see :mod:`ggufpipe_agent.stagefile`) is loaded into a llama.cpp
context; :meth:`StageEngine.step` runs one sequence:

* stage 0 takes token ids, every other stage takes activations [n, hidden];
* a non-last stage returns the residual stream after its last block for every
  position, read from the compute graph through the eval callback, and stops
  the graph right there (final norm and vocabulary projection are skipped);
* the last stage returns the token sampled by llama.cpp's sampler chain.

Sequence 0 is the prefill over the whole prompt; each later sequence is one
token at the next position. :meth:`StageEngine.reset` empties the KV cache for
a new run and keeps the loaded weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ggufpipe_agent.errors import ContextOverflow, EngineError, ProtocolError
from ggufpipe_agent.protocol import EngineOptions, SamplingParams

log = logging.getLogger("ggufpipe.engine")

Progress = Callable[[float], None]

_backend_lock = threading.Lock()
_backend_ready = False
_LLAMA_LOG_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_llama_log = logging.getLogger("ggufpipe.llama")


def _init_backend() -> None:
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


def gpu_offload_supported() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


@dataclass(frozen=True, slots=True)
class StageShape:
    """Where a stage sits in the pipeline."""

    first: bool
    last: bool
    block_count: int  # blocks in this stage file
    hidden: int


class StageEngine:
    """One llama.cpp model and context running a stage file. Not thread-safe:
    the agent calls it from one worker thread."""

    def __init__(
        self,
        path: str,
        shape: StageShape,
        options: EngineOptions,
        progress: Progress | None = None,
    ) -> None:
        import llama_cpp

        _init_backend()
        self._lib = llama_cpp
        self.path = path
        self.shape = shape
        self.options = options
        self._n_past = 0
        self._abort = threading.Event()
        self._closed = False
        self._sampler: ctypes.c_void_p | None = None
        self._capture_name = f"l_out-{shape.block_count - 1}".encode()
        self._capture: np.ndarray | None = None
        self._capture_row = 0

        model_params = llama_cpp.llama_model_default_params()
        gpu = gpu_offload_supported()
        model_params.n_gpu_layers = (
            0 if not gpu else (2**31 - 1 if options.gpu_layers < 0 else options.gpu_layers)
        )
        self._progress_thunk = None
        if progress is not None:

            @llama_cpp.llama_progress_callback
            def on_progress(fraction: float, _user: ctypes.c_void_p) -> bool:
                progress(float(fraction))
                return True

            self._progress_thunk = on_progress
            model_params.progress_callback = on_progress
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise EngineError(f"llama.cpp could not load {path} (see the agent log for why)")

        n_embd = llama_cpp.llama_model_n_embd(self.model)
        if n_embd != shape.hidden:
            self.close()
            raise EngineError(f"{path}: hidden size {n_embd}, the plan says {shape.hidden}")
        threads = options.threads or os.cpu_count() or 1
        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = options.n_ctx
        context_params.n_batch = options.n_batch
        context_params.n_ubatch = options.n_ubatch
        context_params.n_seq_max = 1
        context_params.n_threads = threads
        context_params.n_threads_batch = threads
        context_params.no_perf = True
        self._eval_thunk = None
        if not shape.last:
            self._eval_thunk = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)
            context_params.cb_eval = self._eval_thunk
            context_params.cb_eval_user_data = None
        self._abort_thunk = llama_cpp.ggml_abort_callback(lambda _data: self._abort.is_set())
        self.context = llama_cpp.llama_init_from_model(self.model, context_params)
        if not self.context:
            self.close()
            raise EngineError(f"llama.cpp could not create a context of {options.n_ctx} positions for {path}")
        # llama.cpp may round the context up; the plan's size is the limit.
        self.n_ctx = min(options.n_ctx, llama_cpp.llama_n_ctx(self.context))
        self.n_batch = min(options.n_batch, self.n_ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0 if shape.first else n_embd, 1)
        self._tokens = (
            np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,)) if shape.first else None
        )
        self._embd = (
            None if shape.first else np.ctypeslib.as_array(self._batch.embd, shape=(self.n_batch, n_embd))
        )
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._outputs = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        n_seq_id = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self.n_batch,))
        n_seq_id[:] = 1
        for index in range(self.n_batch):
            self._batch.seq_id[index][0] = 0
        from ggufpipe_agent.ggml import ggml

        self._ggml = ggml()
        self.reset(SamplingParams())

    # ------------------------------------------------------------------ run

    def reset(self, sampling: SamplingParams) -> None:
        """Start a new run: empty KV cache and a fresh sampler chain."""
        lib = self._lib
        lib.llama_memory_clear(lib.llama_get_memory(self.context), True)
        self._n_past = 0
        self._abort.clear()
        if not self.shape.last:
            return
        if self._sampler is not None:
            lib.llama_sampler_free(self._sampler)
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if sampling.temperature <= 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:
            if sampling.top_k > 0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(sampling.top_k))
            if 0 < sampling.top_p < 1:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(sampling.top_p, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(sampling.temperature))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(sampling.seed & 0xFFFFFFFF))
        self._sampler = chain

    def abort(self) -> None:
        """Make a running prefill stop at its next graph node (StopRun)."""
        self._abort.set()

    def step(self, inputs: np.ndarray | list[int]) -> np.ndarray | int:
        """Run one sequence. ``inputs`` is token ids (stage 0) or float32
        activations [n, hidden]. Returns activations [n, hidden] float32, or
        the sampled token id in the last stage."""
        if self._closed:
            raise EngineError("the stage engine is closed")
        if self.shape.first:
            tokens = np.asarray(inputs, dtype=np.int32).reshape(-1)
            n = int(tokens.shape[0])
        else:
            rows = np.asarray(inputs)
            if rows.ndim != 2 or rows.shape[1] != self.shape.hidden:
                raise ProtocolError(
                    f"activation of shape {tuple(rows.shape)}, stage expects [n, {self.shape.hidden}]"
                )
            n = int(rows.shape[0])
        if n == 0:
            raise EngineError("a step needs at least one token")
        if self._n_past + n > self.n_ctx:
            raise ContextOverflow(
                f"context full: {self._n_past} positions used + {n} new > context size "
                f"{self.n_ctx} (raise run.context in the inventory or lower max_tokens)"
            )
        lib = self._lib
        long_step = n > self.options.n_ubatch
        if long_step:
            # Only long prefills can be worth aborting; the callback costs a
            # Python call per graph node, too much for every decode step.
            lib.llama_set_abort_callback(self.context, self._abort_thunk, None)
        if not self.shape.last:
            self._capture = np.empty((n, self.shape.hidden), dtype=np.float32)
            self._capture_row = 0
        try:
            for begin in range(0, n, self.n_batch):
                count = min(self.n_batch, n - begin)
                if self.shape.first:
                    assert self._tokens is not None
                    self._tokens[:count] = tokens[begin : begin + count]
                else:
                    assert self._embd is not None
                    self._embd[:count] = rows[begin : begin + count]
                self._pos[:count] = np.arange(self._n_past, self._n_past + count, dtype=np.int32)
                if self.shape.last:
                    self._outputs[:count] = 0
                    self._outputs[count - 1] = 1 if begin + count == n else 0
                else:
                    # Every row must be an output, or the last block keeps
                    # only the rows flagged for logits.
                    self._outputs[:count] = 1
                self._batch.n_tokens = count
                status = lib.llama_decode(self.context, self._batch)
                if status != 0:
                    if status == 2 or self._abort.is_set():
                        raise EngineError("step aborted")
                    if status == 1:
                        raise ContextOverflow(
                            f"llama.cpp found no KV slot for {count} tokens at position "
                            f"{self._n_past} (context size {self.n_ctx})"
                        )
                    raise EngineError(f"llama_decode failed with status {status}")
                self._n_past += count
        finally:
            if long_step:
                lib.llama_set_abort_callback(self.context, lib.ggml_abort_callback(), None)  # NULL: none
        if self.shape.last:
            return int(lib.llama_sampler_sample(self._sampler, self.context, -1))
        captured, self._capture = self._capture, None
        assert captured is not None
        if self._capture_row != n:
            raise EngineError(
                f"captured {self._capture_row} of {n} activation rows from {self._capture_name.decode()}"
            )
        return captured

    def _on_eval(self, tensor: int, ask: bool, _user: int) -> bool:
        lib = self._ggml
        if ask:
            return bool(lib.get_name(tensor) == self._capture_name)
        if lib.get_name(tensor) != self._capture_name:
            return True
        assert self._capture is not None
        nbytes = lib.nbytes(tensor)
        rows = nbytes // (4 * self.shape.hidden)
        end = self._capture_row + rows
        if end > self._capture.shape[0]:
            return False
        target = self._capture[self._capture_row : end]
        lib.tensor_get(tensor, target.ctypes.data, 0, nbytes)
        self._capture_row = end
        # Stop the graph here: the final norm and the vocabulary projection of a
        # non-last stage are dead work. llama_decode still returns 0 and the KV
        # cache of every block in the stage is written.
        return False

    # -------------------------------------------------------------- cleanup

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        lib = self._lib
        if self._sampler is not None:
            lib.llama_sampler_free(self._sampler)
            self._sampler = None
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "context", None):
            lib.llama_free(self.context)
            self.context = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        # At interpreter shutdown llama_cpp may already be gone: nothing to report to.
        with contextlib.suppress(Exception):
            self.close()
