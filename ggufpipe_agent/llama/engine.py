"""The stage engine (the GPU worker): one layer range of a model in llama.cpp.

A stage file (see :mod:`ggufpipe_agent.stagefiles.build`) is loaded into a llama.cpp
context; :meth:`StageEngine.step` runs one sequence:

* stage 0 takes token ids, every other stage takes activations [n, hidden];
* a non-last stage returns the residual stream after its last block for every
  position, read from the compute graph through the eval callback, and stops
  the graph right there (final norm and vocabulary projection are skipped);
* the last stage returns the token sampled by llama.cpp's sampler chain.

Sequence 0 is the prefill over the prompt; each later sequence is one token
at the next position. A context holds ``EngineOptions.parallel`` slots (llama.cpp
sequence ids, each its own KV stream of ``n_ctx`` positions): :meth:`StageEngine.use`
picks the slot the next calls work on, so several runs step through one stage
each in its own cache (docs/worker.md, "Slots"). :meth:`StageEngine.reset` starts a new run with the
loaded weights, and either empties the KV cache or keeps it for
:meth:`StageEngine.keep`, which trims it to a prefix the new run shares with
the previous one (prefix reuse, docs/worker.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggufpipe_agent.errors import ContextOverflow, EngineError, GgufpipeError, ProtocolError, StepNotStarted
from ggufpipe_agent.ids import EVERY_SLOT, SlotId
from ggufpipe_agent.llama.batches import BatchBuffer
from ggufpipe_agent.llama.capture import RowCapture
from ggufpipe_agent.llama.plumbing import (
    MROPE_TYPES,
    BufferTypeOverride,
    StageShape,
    context_params_for,
    experts_in_ram_overrides,
    gpu_offload_supported,
    init_backend,
    positions_per_token,
)
from ggufpipe_agent.llama.probe import probe_keeping_the_cache
from ggufpipe_agent.llama.sampler import Sampler
from ggufpipe_agent.wire.protocol import EngineOptions, SamplingParams

log = logging.getLogger("ggufpipe.engine")

Progress = Callable[[float], None]


@dataclass(slots=True)
class _Slot:
    """What one sequence id of the context holds."""

    n_past: int = 0  # positions in its KV stream: 0 .. n_past-1
    exact_end: int = 0  # positions [0, this) were computed as a cold run computes them
    sampler: Sampler | None = None  # its run's sampling (the last stage)


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

        init_backend()
        self._lib = llama_cpp
        self.path = path
        self.shape = shape
        self.options = options
        self.parallel = max(1, options.parallel)
        self._slot_states = [_Slot() for _ in range(self.parallel)]
        self._seq = 0  # the slot (llama.cpp sequence id) the calls work on: use()
        self._state = self._slot_states[0]  # what that slot holds
        self._running = -1  # the slot whose step is running
        self._aborting: set[int] = set()  # slots whose steps stop at the next graph node
        self._closed = False
        self._buffer: BatchBuffer | None = None
        from ggufpipe_agent.llama.devices import ggml

        self._capture = RowCapture(ggml(), shape.block_count, shape.hidden)

        model_params = llama_cpp.llama_model_default_params()
        gpu = gpu_offload_supported()
        model_params.n_gpu_layers = (
            0 if not gpu else (2**31 - 1 if options.gpu_layers < 0 else options.gpu_layers)
        )
        self._buft_overrides: ctypes.Array[BufferTypeOverride] | None = None
        if options.experts_in_ram:
            # The routed experts stay in host RAM, the rest of each offloaded
            # block goes to the GPU (the planner's choice, docs/planning.md).
            self._buft_overrides = experts_in_ram_overrides()
            model_params.tensor_buft_overrides = ctypes.addressof(self._buft_overrides)
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
        # A recurrent or hybrid model (qwen3next) holds one state per sequence,
        # not one entry per position: llama_memory_seq_rm cannot drop a suffix
        # of it (no per-token snapshots with n_rs_seq = 0), so a new run keeps
        # the whole state or nothing.
        self.whole_state_only = bool(
            llama_cpp.llama_model_is_recurrent(self.model) or llama_cpp.llama_model_is_hybrid(self.model)
        )

        n_embd = llama_cpp.llama_model_n_embd(self.model)
        if n_embd != shape.hidden:
            self.close()
            raise EngineError(f"{path}: hidden size {n_embd}, the plan says {shape.hidden}")
        context_params = context_params_for(llama_cpp, options, self.parallel)
        self._eval_thunk = None
        if not shape.last:
            self._eval_thunk = llama_cpp.ggml_backend_sched_eval_callback(self._capture.on_eval)
            context_params.cb_eval = self._eval_thunk
            context_params.cb_eval_user_data = None
        self._abort_thunk = llama_cpp.ggml_abort_callback(lambda _data: self._running in self._aborting)
        self.context = llama_cpp.llama_init_from_model(self.model, context_params)
        if not self.context:
            self.close()
            raise EngineError(f"llama.cpp could not create a context of {options.n_ctx} positions for {path}")
        # llama.cpp may round the context up; the plan's size is the limit.
        self.n_ctx = min(options.n_ctx, llama_cpp.llama_n_ctx(self.context) // self.parallel)
        self.n_batch = min(options.n_batch, self.n_ctx)
        self.n_ubatch = min(options.n_ubatch, self.n_batch)
        # A cold run computes its prompt in ubatches that start at multiples of
        # this (prefill chunks are aligned to absolute positions, see step()).
        self.granularity = self.n_ubatch if self.n_batch % self.n_ubatch == 0 else self.n_batch
        # Positions per token of a batch of embeddings: 4 where the model uses
        # M-RoPE (llama.cpp reads them section-major, pos[j * n_tokens + i]).
        mrope = llama_cpp.llama_model_rope_type(self.model) in MROPE_TYPES
        # Only an M-RoPE model's stage file is read again (its header says how many).
        per_token = positions_per_token(path) if mrope and not shape.first else 1
        if mrope and not shape.first and per_token == 1:
            self.close()  # llama.cpp would read 4 positions per embedding, past the buffer
            raise EngineError(f"{path}: llama.cpp reads 4 positions per token, the stage file says 1")
        self._buffer = BatchBuffer(llama_cpp, self.n_batch, 0 if shape.first else n_embd, per_token)
        # Whether a row comes out bit for bit alike in any batch: probed the
        # first time a run may keep a prefix (None: not yet), so a load and a
        # run that keeps nothing pay nothing for it.
        self.batch_invariant: bool | None = None
        self.probe_note = ""
        self.reset(SamplingParams())

    # ------------------------------------------------------------------ run

    @property
    def n_past(self) -> int:
        """Positions in the slot's KV cache: 0 .. n_past-1."""
        return self._state.n_past

    @property
    def slot(self) -> int:
        return self._seq

    def use(self, slot: SlotId) -> None:
        """Work on slot ``slot`` (a llama.cpp sequence id) from now on."""
        if not 0 <= slot < self.parallel:
            raise EngineError(f"slot {slot} does not exist: the stage has {self.parallel}")
        self._seq, self._state = slot, self._slot_states[slot]

    def _clear(self) -> None:
        """Empty the slot's KV cache (the others keep theirs)."""
        lib = self._lib
        memory = lib.llama_get_memory(self.context)
        if self.parallel == 1:
            lib.llama_memory_clear(memory, True)
        elif not lib.llama_memory_seq_rm(memory, self._seq, -1, -1):
            raise EngineError(f"llama.cpp could not empty slot {self._seq} of the KV cache")

    def reset(self, sampling: SamplingParams, keep: bool = False) -> None:
        """Start a new run: a fresh sampler chain and an empty KV cache, or
        (``keep``) the cache as the last run left it, to be trimmed by
        :meth:`keep` when the new run's prompt says where it starts."""
        lib = self._lib
        if not keep:
            self._clear()
            self._state.n_past = 0
            self._state.exact_end = 0
        self._aborting.discard(self._seq)
        if not self.shape.last:
            return
        if self._state.sampler is not None:
            self._state.sampler.free()
            self._state.sampler = None
        self._state.sampler = Sampler(lib, self.model, sampling)

    def keepable(self) -> tuple[int, str]:
        """How many leading positions of the cache a new run may keep, and why
        fewer than all when fewer: all of them (``exact_reuse`` off: one
        context keeping its cache), or only as many as still compute exactly
        what a cold run of the same tokens computes. A new run keeps K of them
        only if K is a multiple of :attr:`keep_granularity`."""
        lib = self._lib
        if self._state.n_past == 0:
            return 0, "its cache is empty"
        if self.whole_state_only:
            # llama_memory_seq_pos_min of a recurrent state is its last position,
            # not a dropped prefix: the check below does not apply.
            if self._state.exact_end == self._state.n_past or not self.options.exact_reuse:
                return self._state.n_past, ""
            return 0, (
                f"its recurrent state keeps all {self._state.n_past} positions or none, and only the "
                f"first {self._state.exact_end} were computed in whole ubatches as a cold run computes them"
            )
        lowest = lib.llama_memory_seq_pos_min(lib.llama_get_memory(self.context), self._seq)
        if lowest > 0:
            # Not with swa_full; kept as a guard should llama.cpp ever evict.
            return 0, f"its sliding-window cache dropped the positions before {lowest}"
        if not self.options.exact_reuse:
            # One context keeping its cache: every position it holds (no probe).
            return self._state.n_past, ""
        if self.batch_invariant is None:
            self.batch_invariant, self.probe_note = probe_keeping_the_cache(self, self._state.exact_end)
            if self._state.n_past == 0:
                return 0, f"its cache was lost to the batch-invariance probe ({self.probe_note})"
        if self.batch_invariant or self._state.exact_end == self._state.n_past:
            return self._state.n_past, ""
        return self._state.exact_end, (
            f"only the first {self._state.exact_end} of its {self._state.n_past} positions were computed "
            f"in whole ubatches as a cold run computes them ({self.probe_note})"
        )

    @property
    def keep_granularity(self) -> int:
        """1 where a row comes out bit for bit the same in any batch; else (or
        not probed yet) a kept prefix must end where a cold run's ubatch
        ends, so that the new run's ubatches are the cold run's."""
        if self.whole_state_only:
            # a kept prefix is a multiple of this and at most n_past: all or nothing
            return max(1, self._state.n_past)
        if not self.options.exact_reuse:
            return 1
        return 1 if self.batch_invariant else self.granularity

    def keep(self, positions: int) -> None:
        """Keep the first ``positions`` positions of the cache and drop the
        rest (``llama_memory_seq_rm``); the run's first step starts there."""
        lib = self._lib
        if not 0 <= positions <= self._state.n_past:
            raise EngineError(f"cannot keep {positions} positions: the cache holds {self._state.n_past}")
        if self.whole_state_only and positions not in (0, self._state.n_past):
            raise EngineError(
                f"cannot keep {positions} positions: a recurrent state keeps all {self._state.n_past} or none"
            )
        memory = lib.llama_get_memory(self.context)
        if positions == 0:
            self._clear()
        elif positions < self._state.n_past and not lib.llama_memory_seq_rm(memory, self._seq, positions, -1):
            raise EngineError(f"llama.cpp could not drop positions {positions}.. of the KV cache")
        self._state.n_past = positions
        self._state.exact_end = min(self._state.exact_end, positions)

    def abort(self, slot: SlotId = EVERY_SLOT) -> None:
        """Make slot ``slot``'s long steps stop at their next graph node until
        its next :meth:`reset` (StopRun); -1: every slot's. Another slot's
        step goes on. Called from any thread."""
        self._aborting.update(range(self.parallel) if slot < 0 else (slot,))

    def step(
        self, inputs: np.ndarray | list[int], position: int | None = None, sample: bool = True
    ) -> np.ndarray | int | None:
        """Run one sequence. ``inputs`` is token ids (stage 0) or float32
        activations [n, hidden]; ``position`` is where its first row goes
        (None: the next position), which must be the next position. Returns
        activations [n, hidden] float32, or the sampled token id in the last
        stage (None where ``sample`` is off: a prompt's chunk that another
        follows computes no logits)."""
        if self._closed:
            raise EngineError("the stage engine is closed")
        if position is not None and position != self._state.n_past:
            raise EngineError(
                f"an object at position {position}, this stage is at position {self._state.n_past} "
                "(the stages disagree on positions)"
            )
        if self._seq in self._aborting:
            raise StepNotStarted("step aborted")  # a step queued (or a prompt's next chunk) after StopRun
        values = self._inputs(inputs)
        n = int(values.shape[0])
        if n == 0:
            raise EngineError("a step needs at least one token")
        if self._state.n_past + n > self.n_ctx:
            raise ContextOverflow(
                f"context full: {self._state.n_past} positions used + {n} new > context size "
                f"{self.n_ctx} (raise run.context in the inventory or lower max_tokens)"
            )
        lib = self._lib
        batch = self._buffer
        assert batch is not None
        long_step = n > self.options.n_ubatch
        if long_step:
            # Only long prefills can be worth aborting; the callback costs a
            # Python call per graph node, too much for every decode step.
            lib.llama_set_abort_callback(self.context, self._abort_thunk, None)
        if not self.shape.last:
            self._capture.begin(n)
        start = self._state.n_past
        seq = self._seq
        batch.sequences(0, min(n, self.n_batch), seq)
        self._running = seq
        try:
            begin = 0
            while begin < n:
                # Chunks end at multiples of n_batch (absolute positions), so a
                # prompt that starts after a kept prefix is cut where a cold
                # run cuts it; llama.cpp cuts each chunk into ubatches.
                if self.options.exact_reuse:
                    count = min(n - begin, self.n_batch - self._state.n_past % self.n_batch)
                else:  # batches from the first new position, as one context is fed
                    count = min(n - begin, self.n_batch)
                batch.put(0, values[begin : begin + count])
                batch.positions(np.arange(self._state.n_past, self._state.n_past + count, dtype=np.int32))
                if self.shape.last:
                    batch.outputs[:count] = 0
                    batch.outputs[count - 1] = 1 if begin + count == n and sample else 0
                else:
                    # Every row must be an output, or the last block keeps
                    # only the rows flagged for logits.
                    batch.outputs[:count] = 1
                self._check(batch.decode(self.context, count), count)
                self._state.n_past += count
                begin += count
        finally:
            self._running = -1
            if long_step:
                lib.llama_set_abort_callback(self.context, lib.ggml_abort_callback(), None)  # NULL: none
        if start == self._state.exact_end and start % self.granularity == 0:
            # Whole ubatches from an aligned start are what a cold run computes.
            self._state.exact_end = start + (n // self.granularity) * self.granularity
        if self.shape.last:
            if not sample:
                return None
            sampler = self._state.sampler
            assert sampler is not None  # reset() made it
            return sampler.sample(self.context)
        return self._capture.take(n)

    def step_batch(self, rows: list[tuple[SlotId, np.ndarray | list[int]]]) -> list[Any]:
        """One decode step of several slots in one ``llama_decode``: a row
        each (a token id, or one activation row), in increasing slot order
        (llama.cpp puts consecutive sequence ids of a batch in one ubatch).
        Returns per slot what :meth:`step` returns, and in the last stage
        (token, logprob words or None) per slot."""
        if self._closed:
            raise EngineError("the stage engine is closed")
        slots = [slot for slot, _ in rows]
        if slots != sorted(set(slots)):
            raise EngineError(f"a batch's slots must increase: {slots}")
        batch = self._buffer
        assert batch is not None
        n = len(rows)
        if n > self.n_batch:
            raise EngineError(f"a batch of {n} rows, the stage's batches hold {self.n_batch}")
        positions = np.empty(n, dtype=np.int32)
        for index, (slot, inputs) in enumerate(rows):
            state = self._slot_states[slot]
            problem = self.row_problem(slot, inputs)
            if problem is not None:
                raise problem
            batch.put(index, self._inputs(inputs))
            batch.sequences(index, 1, slot)
            positions[index] = state.n_past
        batch.positions(positions)
        batch.outputs[:n] = 1
        if not self.shape.last:
            self._capture.begin(n)
        self._check(batch.decode(self.context, n), n)
        for slot in slots:
            self._slot_states[slot].n_past += 1
        if not self.shape.last:
            captured = self._capture.take(n)
            return [captured[index : index + 1] for index in range(n)]
        results: list[Any] = []
        for index, slot in enumerate(slots):
            sampler = self._slot_states[slot].sampler
            assert sampler is not None
            token = sampler.sample(self.context, index)
            results.append((token, sampler.last_logprobs if sampler.sampling.logprobs >= 0 else None))
        return results

    def row_problem(self, slot: SlotId, inputs: np.ndarray | list[int]) -> GgufpipeError | None:
        """Why one slot's decode row cannot go into a batch (its context is
        full, it is not one row of this stage's width), or None: a batch
        leaves such a row out, so the other slots' runs go on."""
        if not 0 <= slot < self.parallel:
            return EngineError(f"slot {slot} does not exist: the stage has {self.parallel}")
        state = self._slot_states[slot]
        if state.n_past + 1 > self.n_ctx:
            return ContextOverflow(
                f"context full: {state.n_past} positions used + 1 new > context size "
                f"{self.n_ctx} (raise run.context in the inventory or lower max_tokens)"
            )
        try:
            values = self._inputs(inputs)
        except GgufpipeError as error:
            return error
        if values.shape[0] != 1:
            return EngineError(f"a batched step takes one row per slot, slot {slot} has {values.shape[0]}")
        return None

    def _inputs(self, inputs: np.ndarray | list[int]) -> np.ndarray:
        """Token ids as int32 [n] (stage 0), or activations checked to be [n, hidden]."""
        if self.shape.first:
            return np.asarray(inputs, dtype=np.int32).reshape(-1)
        rows = np.asarray(inputs)
        if rows.ndim != 2 or rows.shape[1] != self.shape.hidden:
            raise ProtocolError(
                f"activation of shape {tuple(rows.shape)}, stage expects [n, {self.shape.hidden}]"
            )
        return rows

    def _check(self, status: int, count: int) -> None:
        """Raise what a ``llama_decode`` status other than 0 means."""
        if status == 0:
            return
        if status == 2 or self._seq in self._aborting:
            raise EngineError("step aborted")
        if status == 1:
            raise ContextOverflow(
                f"llama.cpp found no KV slot for {count} tokens at position "
                f"{self._state.n_past} (context size {self.n_ctx})"
            )
        raise EngineError(f"llama_decode failed with status {status}")

    @property
    def vocab_size(self) -> int:
        lib = self._lib
        return int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))

    def sampled_logprobs(self) -> np.ndarray | None:
        """The logprob record of the token the slot in use sampled last (its
        run asked for logprobs), as sampler.logprob_payload words."""
        sampler = self._state.sampler
        return None if sampler is None or sampler.sampling.logprobs < 0 else sampler.last_logprobs

    def last_logits(self) -> bytes:
        """The last row's logits after a step of the last stage."""
        logits = self._lib.llama_get_logits_ith(self.context, -1)
        return np.ctypeslib.as_array(logits, shape=(self.vocab_size,)).tobytes()

    def sequence_state(self) -> bytes:
        """The KV cache of the sequence, as llama.cpp serializes it."""
        lib = self._lib
        size = lib.llama_state_seq_get_size(self.context, self._seq)
        buffer = (ctypes.c_uint8 * size)()
        written = lib.llama_state_seq_get_data(self.context, buffer, size, self._seq)
        return ctypes.string_at(buffer, written)  # one copy (the KV cache may be large)

    def restore_sequence(self, state: bytes, positions: int, exact_end: int | None = None) -> None:
        """Put back a :meth:`sequence_state` of ``positions`` positions (and,
        given, the end of the positions computed as a cold run computes them)."""
        lib = self._lib
        self._clear()
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if lib.llama_state_seq_set_data(self.context, buffer, len(state), self._seq) != len(state):
            raise EngineError("llama.cpp could not restore a KV cache it saved")
        self._state.n_past = positions
        if exact_end is not None:
            self._state.exact_end = exact_end

    # -------------------------------------------------------------- cleanup

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        lib = self._lib
        for slot in getattr(self, "_slot_states", ()):
            if slot.sampler is not None:
                slot.sampler.free()
                slot.sampler = None
        buffer = getattr(self, "_buffer", None)
        if buffer is not None:
            buffer.free()
            self._buffer = None
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
