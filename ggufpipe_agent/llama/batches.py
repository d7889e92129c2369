"""The batches a stage feeds llama.cpp: how a prompt is cut, and the one
``llama_batch`` an engine fills.

A prompt is computed in chunks of at most ``n_ubatch`` rows, cut where one
llama.cpp context fed the prompt would cut it (:func:`prefill_chunks`), so a
chunk is one of that context's ubatches: a stage computes a chunk and sends
its rows on at once, and the next stage starts on them while this one
computes the next (docs/worker.md, "Prompts in chunks"). Decode steps of
several runs in flight go into one batch, one row per slot
(:meth:`BatchBuffer.fill`), each row its slot's sequence id.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


def prefill_chunks(start: int, rows: int, n_batch: int, n_ubatch: int, aligned: bool) -> list[int]:
    """The row counts a prompt of ``rows`` rows from position ``start`` is
    computed in: the batches one llama.cpp context is fed (``n_batch`` rows
    from the first new position, or, ``aligned``, ending at multiples of
    ``n_batch`` in absolute positions, as a cold run cuts them), each cut
    into ubatches of ``n_ubatch`` from the batch's start, as llama.cpp cuts a
    batch of one sequence."""
    counts: list[int] = []
    position, end = start, start + rows
    while position < end:
        batch = n_batch - position % n_batch if aligned else n_batch
        batch = min(batch, end - position)
        counts += [n_ubatch] * (batch // n_ubatch) + ([batch % n_ubatch] if batch % n_ubatch else [])
        position += batch
    return counts


class BatchBuffer:
    """One ``llama_batch`` of ``n_batch`` rows and numpy views of its arrays:
    token ids (a first stage) or embeddings, positions (``per_token`` of them
    per row where the model uses M-RoPE, section-major as llama.cpp reads
    them), one sequence id per row and the output flags."""

    def __init__(self, lib: Any, n_batch: int, n_embd: int, per_token: int) -> None:
        self._lib = lib
        self.n_batch = n_batch
        self.per_token = per_token
        self.batch = lib.llama_batch_init(n_batch, n_embd, 1)
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(n_batch,)) if n_embd == 0 else None
        self.embd = None if n_embd == 0 else np.ctypeslib.as_array(self.batch.embd, shape=(n_batch, n_embd))
        # The address llama_batch_free frees (a ctypes pointer read from the
        # struct would follow the field when it changes).
        self._own_pos = ctypes.cast(self.batch.pos, ctypes.c_void_p).value
        if per_token > 1:  # more positions per token than llama_batch_init allocates
            self._pos_buffer = np.zeros(n_batch * per_token, dtype=np.int32)
            self.batch.pos = self._pos_buffer.ctypes.data_as(type(self.batch.pos))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(n_batch * per_token,))
        self.outputs = np.ctypeslib.as_array(self.batch.logits, shape=(n_batch,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n_batch,))[:] = 1
        # The sequence id each row carries, mirrored: setting one through
        # ctypes costs a Python call, so only changed rows are set.
        self._seqs = np.zeros(n_batch, dtype=np.int32)
        for index in range(n_batch):
            self.batch.seq_id[index][0] = 0

    def put(self, at: int, values: np.ndarray) -> None:
        """Rows ``at..`` of the batch: token ids or embeddings."""
        target = self.tokens if self.tokens is not None else self.embd
        assert target is not None
        target[at : at + len(values)] = values

    def sequences(self, at: int, count: int, seq: int) -> None:
        """Rows ``at .. at+count`` belong to sequence ``seq``."""
        changed = np.flatnonzero(self._seqs[at : at + count] != seq)
        for index in changed.tolist():
            self.batch.seq_id[at + index][0] = seq
        self._seqs[at : at + count] = seq

    def positions(self, values: np.ndarray) -> None:
        """Every row's position (the batch's ``len(values)`` rows); text
        positions as llama.cpp expands them for M-RoPE: [p, p, p, 0]."""
        count = len(values)
        if self.per_token == 1:
            self.pos[:count] = values
            return
        sections = self.pos[: self.per_token * count].reshape(self.per_token, count)
        sections[:] = values
        sections[3:] = 0

    def decode(self, context: Any, count: int) -> int:
        """``llama_decode`` of the first ``count`` rows; llama.cpp's status."""
        self.batch.n_tokens = count
        return int(self._lib.llama_decode(context, self.batch))

    def free(self) -> None:
        if self.batch is None:
            return
        if self._own_pos is not None:  # llama_batch_init's, not our position buffer
            self.batch.pos = ctypes.cast(self._own_pos, type(self.batch.pos))
        self._lib.llama_batch_free(self.batch)
        self.batch = None
