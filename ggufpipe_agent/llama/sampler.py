"""One run's sampling in the last stage, as llama-server samples.

llama-server (llama.cpp's common sampler) builds one chain per request:
logit bias (with the vocabulary's suppressed tokens), then its samplers in
order (penalties, DRY, top-n-sigma, top-k, typical, top-p, min-p, XTC,
temperature) and a seeded draw, or temperature and mirostat; it feeds the
prompt's tokens to the chain before the reply (the penalties look back over
them), and holds a grammar apart: the chain picks, the grammar checks the
pick, and only a pick it refuses is drawn again with the grammar pruning
first. :class:`Sampler` does each of these the same way, with the same
llama.cpp samplers, so a seeded reply is llama-server's reply.

Logprobs are llama-server's (``post_sampling_probs`` off): the softmax of the
raw logits, before any sampler; the sampled token's own and the ``logprobs``
likeliest, carried back in the token's record (:func:`logprob_payload`).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ggufpipe_agent.errors import EngineError
from ggufpipe_agent.wire.records import SamplingParams

#: A greedy run with nothing else to do keeps llama.cpp's greedy sampler:
#: the likeliest token, as the chain at temperature 0 picks it.
_PLAIN_GREEDY = SamplingParams()


class Sampler:
    """The sampler chain (and grammar) of one run on the last stage."""

    def __init__(self, lib: Any, model: Any, sampling: SamplingParams) -> None:
        self._lib = lib
        self.sampling = sampling
        self._vocab = lib.llama_model_get_vocab(model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.grammar: Any = None
        self._keep: list[Any] = []  # ctypes arrays llama.cpp reads while it builds
        self.chain = self._chain(sampling)
        if sampling.grammar:
            grammar = lib.llama_sampler_init_grammar(self._vocab, sampling.grammar.encode(), b"root")
            if not grammar:
                self.free()
                raise EngineError("llama.cpp could not parse the grammar")
            self.grammar = grammar
        for token in sampling.history:  # llama-server's init_sampler: the prompt, not to the grammar
            lib.llama_sampler_accept(self.chain, token)
        if sampling.skip_draws and not _is_plain_greedy(sampling):
            # A resumed run (its history holds the tokens it streamed): the
            # seeded draw it made for each, so the next pick is the one it
            # would have made. The dist sampler draws once per pick, even of
            # a single candidate (SamplingParams.resumable says when that is all).
            single = np.zeros(1, dtype=_TOKEN_DATA)
            for _ in range(sampling.skip_draws):
                single[0] = (0, 0.0, 0.0)
                one = _array(lib, single)
                lib.llama_sampler_apply(self.chain, ctypes.byref(one))
        self._keep.clear()
        self._cur = np.zeros(self.n_vocab, dtype=_TOKEN_DATA) if self.grammar is not None else None
        self._ids = np.arange(self.n_vocab, dtype=np.int32) if self.grammar is not None else None
        #: The last sampled token's logprob record (logprob_payload), when asked.
        self.last_logprobs: np.ndarray | None = None

    def _chain(self, s: SamplingParams) -> Any:
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if _is_plain_greedy(s):
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        parts = []
        bias = self._logit_bias(s)
        if bias is not None:
            parts.append(bias)
        seed = s.seed & 0xFFFFFFFF
        if s.mirostat == 0:
            for name in s.samplers:
                parts.append(self._one(name, s, seed))
            parts.append(lib.llama_sampler_init_dist(seed))
        elif s.mirostat == 1:
            parts.append(lib.llama_sampler_init_temp(s.temperature))
            parts.append(
                lib.llama_sampler_init_mirostat(self.n_vocab, seed, s.mirostat_tau, s.mirostat_eta, 100)
            )
        else:
            parts.append(lib.llama_sampler_init_temp(s.temperature))
            parts.append(lib.llama_sampler_init_mirostat_v2(seed, s.mirostat_tau, s.mirostat_eta))
        for part in parts:
            lib.llama_sampler_chain_add(chain, part)
        return chain

    def _one(self, name: str, s: SamplingParams, seed: int) -> Any:
        lib = self._lib
        if name == "penalties":
            return lib.llama_sampler_init_penalties(
                self.n_vocab, s.repeat_last_n, s.repeat_penalty, s.frequency_penalty, s.presence_penalty
            )
        if name == "dry":
            breakers = [b.encode() for b in s.dry_sequence_breakers]
            array = (ctypes.c_char_p * max(1, len(breakers)))(*breakers)
            self._keep.append(array)
            return lib.llama_sampler_init_dry(
                self._vocab,
                s.dry_multiplier,
                s.dry_base,
                s.dry_allowed_length,
                s.dry_penalty_last_n,
                array,
                len(breakers),
            )
        if name == "top_n_sigma":
            return lib.llama_sampler_init_top_n_sigma(s.top_n_sigma)
        if name == "top_k":
            return lib.llama_sampler_init_top_k(s.top_k)
        if name == "typ_p":
            return lib.llama_sampler_init_typical(s.typical_p, s.min_keep)
        if name == "top_p":
            return lib.llama_sampler_init_top_p(s.top_p, s.min_keep)
        if name == "min_p":
            return lib.llama_sampler_init_min_p(s.min_p, s.min_keep)
        if name == "xtc":
            return lib.llama_sampler_init_xtc(s.xtc_probability, s.xtc_threshold, s.min_keep, seed)
        if name == "temperature":
            return lib.llama_sampler_init_temp_ext(s.temperature, s.dynatemp_range, s.dynatemp_exponent)
        raise EngineError(f"unknown sampler {name!r}")

    def _logit_bias(self, s: SamplingParams) -> Any:
        """The user's biases and the vocabulary's suppressed tokens (-inf)."""
        lib = self._lib
        merged = list(s.logit_bias)
        count = ctypes.c_int32(0)
        suppressed = lib.llama_vocab_get_suppress_tokens(self._vocab, ctypes.byref(count))
        merged += [(int(suppressed[i]), float("-inf")) for i in range(count.value)] if suppressed else []
        if not merged:
            return None
        array = (lib.llama_logit_bias * len(merged))()
        for i, (token, bias) in enumerate(merged):
            array[i].token, array[i].bias = token, bias
        self._keep.append(array)
        return lib.llama_sampler_init_logit_bias(self.n_vocab, len(merged), array)

    # ------------------------------------------------------------- sampling

    def sample(self, context: Any, row: int = -1) -> int:
        """The next token from the logits of the batch's row ``row`` (-1: its
        last); the chain (and grammar) accept it, and :attr:`last_logprobs`
        holds its logprobs when asked."""
        lib = self._lib
        if self.grammar is None and self.sampling.logprobs < 0:
            return int(lib.llama_sampler_sample(self.chain, context, row))  # applies and accepts
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(context, row), shape=(self.n_vocab,))
        if self.grammar is None:
            token = int(lib.llama_sampler_sample(self.chain, context, row))
        else:
            token = self._sample_with_grammar(logits)
            lib.llama_sampler_accept(self.grammar, token)
            lib.llama_sampler_accept(self.chain, token)
        if self.sampling.logprobs >= 0:
            self.last_logprobs = logprob_payload(logits, token, self.sampling.logprobs)
        return token

    def _sample_with_grammar(self, logits: np.ndarray) -> int:
        """llama.cpp's common_sampler_sample: the chain's pick if the grammar
        takes it; else the grammar prunes, then the chain picks again."""
        token = self._apply(logits, grammar_first=False)
        lib = self._lib
        single = np.zeros(1, dtype=_TOKEN_DATA)
        single[0] = (token, 1.0, 0.0)
        one = _array(lib, single)
        lib.llama_sampler_apply(self.grammar, ctypes.byref(one))
        if np.isfinite(single[0]["logit"]):
            return token
        return self._apply(logits, grammar_first=True)

    def _apply(self, logits: np.ndarray, grammar_first: bool) -> int:
        cur = self._cur
        assert cur is not None
        cur["id"] = self._ids  # the samplers reorder and cut the array: it is set afresh each step
        cur["logit"] = logits
        cur["p"] = 0.0
        lib = self._lib
        array = _array(lib, cur)
        if grammar_first:
            lib.llama_sampler_apply(self.grammar, ctypes.byref(array))
        lib.llama_sampler_apply(self.chain, ctypes.byref(array))
        if not 0 <= array.selected < array.size:
            raise EngineError("the sampler chain selected no token (the grammar allows none?)")
        return int(array.data[array.selected].id)

    def free(self) -> None:
        lib = self._lib
        if self.chain is not None:
            lib.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar is not None:
            lib.llama_sampler_free(self.grammar)
            self.grammar = None


#: llama.h's llama_token_data: {llama_token id; float logit; float p}.
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


def _array(lib: Any, rows: np.ndarray) -> Any:
    """llama.h's llama_token_data_array over a numpy array of _TOKEN_DATA."""
    data = ctypes.cast(rows.ctypes.data, ctypes.POINTER(lib.llama_token_data))
    return lib.llama_token_data_array(data=data, size=len(rows), selected=-1, sorted=False)


def _is_plain_greedy(s: SamplingParams) -> bool:
    """Greedy with nothing that could change the likeliest token."""
    if s.temperature > 0 or s.logit_bias or s.uses_history:
        return False
    return s.mirostat == 0


def logprob_payload(logits: np.ndarray, token: int, top: int) -> np.ndarray:
    """int32 words: the token, its logprob, then ``top`` (id, logprob) pairs,
    likeliest first, logprobs as float32 bits (llama-server's
    get_token_probabilities: a float32 softmax of the raw logits)."""
    values = logits.astype(np.float32, copy=False)
    peak = values.max()
    exp = np.exp(values - peak, dtype=np.float32)
    total = np.float32(exp.sum(dtype=np.float32))
    with np.errstate(divide="ignore"):
        logprob = np.log(exp / total, dtype=np.float32)
    count = min(top, len(values))
    if count:
        best = np.argpartition(-values, count - 1)[:count]
        best = best[np.lexsort((best, -values[best]))]
    else:
        best = np.zeros(0, dtype=np.int64)
    words = np.empty(2 + 2 * count, dtype="<i4")
    words[0] = token
    words[1:2] = np.asarray([logprob[token]], dtype="<f4").view("<i4")
    words[2::2] = best
    words[3::2] = logprob[best].astype("<f4").view("<i4")
    return words


def grammar_problem(grammar: str) -> str:
    """Why llama.cpp's grammar parser refuses ``grammar``; '' when it parses.
    It needs no model: the server checks a request's grammar with the parser
    the last stage runs, before any run is made."""
    import llama_cpp

    from ggufpipe_agent.llama.plumbing import init_backend

    init_backend()  # llama.cpp's log goes to ours: its complaint is not printed on stderr
    sampler = llama_cpp.llama_sampler_init_grammar(None, grammar.encode(), b"root")
    if not sampler:
        return "llama.cpp cannot parse this grammar (GBNF with a root rule is required)"
    llama_cpp.llama_sampler_free(sampler)
    return ""
