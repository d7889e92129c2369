"""One llama.cpp context decoding K sequences batched: the reference of issue 38's
"Batched decode across runs in flight" (what ggufpipe's stages could reach if each step
computed every run's row in one ``llama_decode``).

llama-cpp-python's low-level API, no server: a context of ``n_seq_max = K`` sequences,
each its own KV stream of ``per_seq`` positions (``kv_unified`` off, as the stages' slots),
the K prompts prefilled in one batch (a logit at each prompt's last token), then one
``llama_decode`` per step holding the K sequences' next tokens, greedy (argmax).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np


@llama_cpp.llama_log_callback
def _quiet(level: int, text: bytes, user: ctypes.c_void_p) -> None:
    """llama.cpp's log, dropped (the benchmark prints its own lines)."""


class BatchedContext:
    """The whole model, one context of ``sequences`` sequences on ``threads`` threads."""

    def __init__(
        self, path: Path, threads: int, sequences: int, per_seq: int, n_batch: int = 2048, n_ubatch: int = 512
    ) -> None:
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = sequences * per_seq
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch
        params.n_seq_max = sequences
        params.kv_unified = False
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make the context")
        self.sequences = sequences
        self.n_batch = n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """Rows (token, position, sequence, wants logits) in batches of n_batch; the
        argmax of each row that wants logits, in order."""
        out = []
        for begin in range(0, len(rows), self.n_batch):
            part = rows[begin : begin + self.n_batch]
            batch = self.batch
            batch.n_tokens = len(part)
            for i, (token, pos, seq, logits) in enumerate(part):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = logits
            code = llama_cpp.llama_decode(self.ctx, batch)
            if code != 0:
                raise RuntimeError(f"llama_decode returned {code}")
            for i, (_, _, _, logits) in enumerate(part):
                if logits:
                    row = llama_cpp.llama_get_logits_ith(self.ctx, i)
                    out.append(int(np.ctypeslib.as_array(row, shape=(self.vocab,)).argmax()))
        return out

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """The prompts (at most ``sequences``) from a cleared cache, ``max_tokens`` greedy
        tokens each: tokens/s (all of them over the wall time from the start to the last
        step's end), time to first token (the batched prefill and the first argmax) and
        the decode rate after it."""
        if len(prompts) > self.sequences:
            raise ValueError(f"{len(prompts)} prompts for {self.sequences} sequences")
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        started = time.perf_counter()
        rows = [
            (token, pos, seq, pos == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for pos, token in enumerate(prompt)
        ]
        last = self._decode(rows)
        first = time.perf_counter()
        outputs = [[token] for token in last]
        positions = [len(prompt) for prompt in prompts]
        for _ in range(max_tokens - 1):
            rows = [(out[-1], positions[seq], seq, True) for seq, out in enumerate(outputs)]
            for seq, token in enumerate(self._decode(rows)):
                outputs[seq].append(token)
                positions[seq] += 1
        done = time.perf_counter()
        k = len(prompts)
        return {
            "tok_s": k * max_tokens / (done - started),
            "wall_s": done - started,
            "ttft_ms": (first - started) * 1000.0,
            "decode_tok_s": k * (max_tokens - 1) / (done - first) if max_tokens > 1 else 0.0,
            "outputs": outputs,
        }

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)
