"""The records inside control messages (not messages on their own): what an
edge carries, a stage's model facts, engine and sampling options, memory and
model facts, the prefix offered and held, step counters, a stage file's
reference. Frozen dataclasses, written by the codec as maps of their fields;
:mod:`ggufpipe_agent.wire.protocol` names them too."""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

from ggufpipe_agent.errors import CacheError
from ggufpipe_agent.ids import NO_RUN, EdgeId, RunId


@dataclass(frozen=True, slots=True)
class ObjectSpec:
    """What one edge carries: rows of ``width`` elements of ``dtype``."""

    kind: str  # "tokens" or "activation"
    dtype: str  # "int32", "float32" or "float16"
    width: int  # 1 for tokens, hidden_dim for activations
    max_rows: int  # the run's max_seq_len

    @property
    def itemsize(self) -> int:
        return {"int32": 4, "float32": 4, "float16": 2}[self.dtype]

    @property
    def max_extent(self) -> int:
        """docs/design.md, "Object records": ``max_seq_len * hidden_dim * dtype_width_bytes``."""
        return self.max_rows * self.width * self.itemsize


@dataclass(frozen=True, slots=True)
class RingSpec:
    """A bounded ring of object records at one edge end (docs/rings.md)."""

    slots: int
    slot_bytes: int


@dataclass(frozen=True, slots=True)
class InboundEdgeProvision:
    edge_id: EdgeId
    kind: str  # EdgeKind: "TokenIn" or "Activation"
    object_spec: ObjectSpec
    ring_spec: RingSpec


@dataclass(frozen=True, slots=True)
class OutboundEdgeProvision:
    edge_id: EdgeId
    kind: str  # EdgeKind: "Activation" or "TokenOut"
    consumer_node_id: str
    object_spec: ObjectSpec
    ring_spec: RingSpec


@dataclass(frozen=True, slots=True)
class TokenRingProvision:
    """The token ring (docs/rings.md): the last stage writes each sampled token
    straight to stage 0 as its next input, on an edge of its own, until EOS/EOG
    or ``max_tokens``; the orchestrator only reads the token-out edge."""

    edge_id: EdgeId
    produce: bool  # this stage writes the ring (the last stage)
    consume: bool  # this stage reads it (stage 0)
    object_spec: ObjectSpec
    eog_token_ids: tuple[int, ...]  # the last stage stops feeding after one of these
    max_tokens: int  # ... or once this many tokens are generated


@dataclass(frozen=True, slots=True)
class StageModelFacts:
    model_id: str
    architecture: str
    block_count: int
    hidden_dim: int
    vocab_size: int
    dtype_family: str  # "float"
    dtype_width_bytes: int  # 4 for float32 activations, 2 for float16
    max_seq_len: int


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How a stage runs llama.cpp. ``threads=0`` means one per core;
    ``gpu_layers=-1`` offloads every layer when the build has a GPU backend."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    threads: int = 0
    gpu_layers: int = -1
    #: A mixture of experts' routed experts (``*_exps`` tensors) stay in host
    #: RAM while the rest of each offloaded block goes to the GPU (llama.cpp's
    #: ``--cpu-moe``: a tensor buffer-type override to the CPU). The planner
    #: sets it (inventory ``experts:``; docs/planning.md).
    experts_in_ram: bool = False
    #: What a new run may keep of the KV cache (docs/worker.md, "Prefix reuse").
    #: False (run.reuse: cache, the default): every position the stage holds of
    #: the previous run, as one llama.cpp context keeps its cache between
    #: requests (llama-server's cache_prompt); prompts are then fed in batches
    #: from the first new position, as that context is fed. True (run.reuse:
    #: exact): only what a cold run of the same tokens computes alike, so a
    #: follow-up is token-identical to a cold run; prefill batches are aligned
    #: to absolute positions, and a probe decides whether rows are batch-invariant.
    exact_reuse: bool = False
    #: Slots: sequences the stage holds at once, each its own KV cache of
    #: ``n_ctx`` positions (llama.cpp sequence ids). A run's provision names
    #: its slot; runs on different slots are in flight together (docs/architecture.md, "Runs in flight").
    parallel: int = 1
    #: The decode steps of the runs in flight on a stage are computed in one
    #: batch (ggufpipe_agent/stage/batching.py); False (run.batching: off):
    #: each alone, so a run's output is what it is alone.
    batching: bool = True


#: llama-server's samplers, in its default order (its ``samplers`` field).
SAMPLER_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The last stage's sampler chain, in llama-server's terms and order
    (llama.cpp's common sampler): logit bias, penalties, DRY, top-n-sigma,
    top-k, typical, top-p, min-p, XTC, temperature, then a seeded draw; or
    temperature and mirostat (1 or 2) in place of the middle. The defaults are
    llama-server's but ``temperature``, which is the inventory's (greedy: a
    temperature of 0 keeps only the likeliest token, whatever else is set).

    ``grammar``: GBNF the reply is held to (llama-server's rejection sampling:
    the chain's pick is kept if the grammar allows it, else the grammar
    prunes first and the chain picks again). ``logprobs``: how many
    alternatives each sampled token's record carries back (-1: no logprobs;
    0: only the token's own). ``history``: the prompt's last tokens, which
    llama-server feeds its sampler before the reply (the penalties and DRY
    look back over them); empty unless one of those is on. ``skip_draws``:
    the seeded draws a resumed run's sampler makes before its first pick (an
    interrupted run carried on after the tokens it streamed: one per token,
    so its next pick is the one it would have made; docs/recovery.md)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    min_keep: int = 0
    samplers: tuple[str, ...] = SAMPLER_ORDER
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str = ""
    logprobs: int = -1
    history: tuple[int, ...] = ()
    skip_draws: int = 0

    @property
    def resumable(self) -> bool:
        """Whether a sampler of these settings can be carried on after N
        tokens from the tokens alone (the history and N draws): not with a
        grammar (a refused pick draws twice), mirostat (its state follows the
        logits) or XTC (it draws only where two candidates are left)."""
        return not self.grammar and self.mirostat == 0 and self.xtc_probability <= 0.0

    @property
    def history_window(self) -> int:
        """How many tokens before the reply the penalties and DRY look back
        over: 0 none (neither is on), -1 all of them."""
        penalties = (self.repeat_penalty, self.frequency_penalty, self.presence_penalty) != (1.0, 0.0, 0.0)
        windows = [self.repeat_last_n] if penalties else []
        windows += [self.dry_penalty_last_n] if self.dry_multiplier != 0.0 else []
        return -1 if -1 in windows else max(windows, default=0)

    @property
    def uses_history(self) -> bool:
        """Whether the penalties or DRY look back at the tokens before the reply."""
        return self.history_window != 0


#: The sampling a stage accepts, one definition for both sides: the agent
#: refuses a provision outside it (validation.py) and the orchestrator refuses
#: a user's or an HTTP request's values outside it before any run is made.
TEMPERATURE_MAX = 1e6
TOP_K_MAX = (1 << 31) - 1  # llama_sampler_init_top_k takes an int32
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # the API's range; llama.cpp takes the low 32 bits
INT32_MAX = (1 << 31) - 1
#: The most alternatives a token's logprobs name (OpenAI's top_logprobs goes to 20).
LOGPROBS_MAX = 100
#: The most GBNF bytes, logit biases, DRY breakers and history tokens a run carries.
GRAMMAR_MAX = 1 << 20
LOGIT_BIAS_MAX = 1 << 16
DRY_BREAKERS_MAX = 64
HISTORY_MAX = 1 << 20

#: The other sampling fields: (low, high), both included; llama.cpp's own
#: limits where it has them, else a range outside which a field means nothing.
SAMPLER_RANGES: dict[str, tuple[float, float]] = {
    "min_p": (0.0, 1.0),
    "typical_p": (0.0, 1.0),
    "top_n_sigma": (-1.0, 1e6),
    "xtc_probability": (0.0, 1.0),
    "xtc_threshold": (0.0, 1.0),
    "dynatemp_range": (0.0, 1e6),
    "dynatemp_exponent": (0.0, 1e6),
    "repeat_penalty": (1e-6, 1e6),
    "repeat_last_n": (-1, INT32_MAX),
    "frequency_penalty": (-1e6, 1e6),
    "presence_penalty": (-1e6, 1e6),
    "dry_multiplier": (0.0, 1e6),
    "dry_base": (1.0, 1e6),
    "dry_allowed_length": (0, INT32_MAX),
    "dry_penalty_last_n": (-1, INT32_MAX),
    "mirostat": (0, 2),
    "mirostat_tau": (0.0, 1e6),
    "mirostat_eta": (0.0, 1e6),
    "min_keep": (0, INT32_MAX),
}
#: The fields of SAMPLER_RANGES that are integers.
SAMPLER_INTEGERS = frozenset(
    {"repeat_last_n", "dry_allowed_length", "dry_penalty_last_n", "mirostat", "min_keep"}
)


def sampling_problem(temperature: float, top_k: int, top_p: float, seed: int) -> tuple[str, str]:
    """(field, what is wrong) for sampling a stage would refuse; ("", "") when sound."""
    if not (
        isinstance(temperature, int | float)
        and math.isfinite(temperature)
        and 0 <= temperature <= TEMPERATURE_MAX
    ):
        return "temperature", f"{temperature!r} is not a finite number in [0, {TEMPERATURE_MAX:g}]"
    if not (isinstance(top_k, int) and 0 <= top_k <= TOP_K_MAX):
        return "top_k", f"{top_k!r} is not an integer in [0, {TOP_K_MAX}]"
    if not (isinstance(top_p, int | float) and math.isfinite(top_p) and 0 < top_p <= 1):
        return "top_p", f"{top_p!r} is not a number in (0, 1]"
    if not (isinstance(seed, int) and SEED_MIN <= seed <= SEED_MAX):
        return "seed", f"{seed!r} is not an integer in [{SEED_MIN}, {SEED_MAX}]"
    return "", ""


def sampler_field_problem(name: str, value: object) -> str:
    """What is wrong with one of :data:`SAMPLER_RANGES`' fields; '' when sound."""
    low, high = SAMPLER_RANGES[name]
    if name in SAMPLER_INTEGERS:
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            return f"{value!r} is not an integer in [{low:g}, {high:g}]"
        return ""
    if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)):
        return f"{value!r} is not a finite number"
    if not low <= value <= high:
        return f"{value!r} is not in [{low:g}, {high:g}]"
    return ""


def sampler_problem(sampling: SamplingParams, vocab_size: int = INT32_MAX) -> tuple[str, str]:
    """(field, what is wrong) for any field of ``sampling``; ("", "") when sound."""
    s = sampling
    field, problem = sampling_problem(s.temperature, s.top_k, s.top_p, s.seed)
    if field:
        return field, problem
    for name in SAMPLER_RANGES:
        problem = sampler_field_problem(name, getattr(s, name))
        if problem:
            return name, problem
    if len(s.dry_sequence_breakers) > DRY_BREAKERS_MAX or any(not b for b in s.dry_sequence_breakers):
        return "dry_sequence_breakers", f"at most {DRY_BREAKERS_MAX} strings, none empty"
    unknown = [name for name in s.samplers if name not in SAMPLER_ORDER]
    if unknown or len(s.samplers) > 4 * len(SAMPLER_ORDER):
        return (
            "samplers",
            f"{unknown[0] if unknown else len(s.samplers)!r}: one of {', '.join(SAMPLER_ORDER)}",
        )
    if len(s.logit_bias) > LOGIT_BIAS_MAX:
        return "logit_bias", f"at most {LOGIT_BIAS_MAX} entries"
    for token, bias in s.logit_bias:
        if not 0 <= token < vocab_size:
            return "logit_bias", f"token {token} is not in the vocabulary (0..{vocab_size - 1})"
        if not (math.isfinite(bias) or bias == -math.inf):
            return "logit_bias", f"the bias of token {token} is {bias!r}"
    if len(s.grammar.encode()) > GRAMMAR_MAX:
        return "grammar", f"more than {GRAMMAR_MAX} bytes"
    if not -1 <= s.logprobs <= LOGPROBS_MAX:
        return "logprobs", f"{s.logprobs} is not in [-1, {LOGPROBS_MAX}]"
    if len(s.history) > HISTORY_MAX or any(not 0 <= t < vocab_size for t in s.history):
        return "history", f"more than {HISTORY_MAX} tokens, or one outside the vocabulary"
    return "", ""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation, as the model's chat template takes it."""

    role: str  # "system", "user", "assistant" or "tool"
    content: str
    #: The turn's other fields as the chat template takes them, as JSON text
    #: of an object (an assistant's tool_calls, a tool result's tool_call_id
    #: and name); "" when it has none.
    fields: str = ""


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    description: str
    memory_total: int
    memory_free: int


@dataclass(frozen=True, slots=True)
class MemoryFacts:
    """What llama.cpp's memory for a layer range depends on, read from the GGUF
    header where the model lives (:func:`ggufpipe_agent.gguf.memory.memory_facts`);
    :mod:`ggufpipe_agent.gguf.memory` sizes a stage from it (docs/planning.md)."""

    block_bytes: tuple[int, ...]  # tensor bytes of each block
    token_embd_bytes: int
    output_norm_bytes: int
    output_bytes: int  # output.weight; 0 when the projection is tied to token_embd
    global_bytes: int  # other tensors outside the blocks (rope_freqs, rope factors, ...)
    kv_widths: tuple[int, ...]  # per block: K + V elements per cache cell
    swa_blocks: tuple[bool, ...]  # per block: a sliding-window block
    sliding_window: int  # 0 when the model has none
    n_embd: int
    n_vocab: int
    n_ff: int  # feed-forward width per token (n_ff_exp * n_expert_used for experts)
    q_width: int  # n_head * key_length
    # Per block: the routed experts' bytes (the tensors llama.cpp's --cpu-moe
    # pattern moves, memory.EXPERTS_PATTERN), and its largest such tensor (what
    # llama.cpp copies to a GPU for a prompt ubatch when they stay in RAM).
    # Empty: no experts (or a record from before they were counted).
    expert_bytes: tuple[int, ...] = ()
    expert_tensor_bytes: tuple[int, ...] = ()
    output_kept: bool = False  # output.weight is in every stage file (Architecture.keep_tensors)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the orchestrator needs to know of a GGUF model (``GgufModelPlan``:
    docs/design.md, "The run plan and its checks")."""

    path: str
    name: str
    architecture: str
    file_type: str
    file_size: int
    block_count: int
    hidden_dim: int
    context_length: int
    vocab_size: int
    head_count: int
    head_count_kv: int
    key_length: int
    value_length: int
    bos_token_id: int  # -1 when the model has none
    eos_token_id: int
    eog_token_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str  # "" when the file has none
    block_bytes: tuple[int, ...]  # tensor bytes of each block
    embedding_bytes: int  # token_embd.weight
    output_bytes: int  # output_norm.weight and output.weight when present
    memory: MemoryFacts | None = None  # None: a hand-made record (tests); see memory.memory_facts_of

    @property
    def stem(self) -> str:
        return self.name or self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True, slots=True)
class PrefixOffer:
    """In a provision: the stage may keep up to ``positions`` positions of
    its KV cache written by run ``run_id`` (the previous run on this chain;
    0: none, start empty). What it keeps is decided when the prompt comes,
    by the prompt object's position (docs/worker.md, "Prefix reuse").

    ``resume``: the run carries on the offered one (interrupted by a lost
    stage) at exactly ``positions``, its next step in the shape it had: no
    granularity applies. ``resend``: the next stage was started again; before
    the prompt, this stage sends it the rows it sent of the offered run, as
    parts flagged REBUILD (docs/recovery.md, "Replay in proportion")."""

    run_id: RunId = NO_RUN
    positions: int = 0
    resume: bool = False
    resend: bool = False


@dataclass(frozen=True, slots=True)
class PrefixHeld:
    """In StageReady: what a stage still holds of the offered run. A prompt
    may start at position K only if K is 0, or K <= ``positions`` and K is a
    multiple of ``granularity`` (1 where the stage's kernels are exact at
    any batch size, else the ubatch: see docs/worker.md). ``reason`` says
    why it holds less than it was offered ("" when it holds all of it).
    ``sent``: of the offered positions, how many (from 0) this stage still
    holds the outbound rows of, to send a rebuilt next stage."""

    run_id: RunId = NO_RUN
    positions: int = 0
    granularity: int = 1
    reason: str = ""
    sent: int = 0


@dataclass(frozen=True, slots=True)
class StepCounters:
    """A stage's work in one run. ``steps``, ``total_ms`` and ``mean_ms`` count
    decode steps only; the prefill (sequence 0) has its own ``prefill_ms``,
    ``prefill_rows`` (rows it computed) and ``kept`` (positions it kept from
    the previous run instead of computing them)."""

    steps: int = 0
    last_ms: float = 0.0
    total_ms: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    prefill_ms: float = 0.0
    prefill_rows: int = 0
    kept: int = 0

    @property
    def mean_ms(self) -> float:
        return self.total_ms / self.steps if self.steps else 0.0


@dataclass(frozen=True, slots=True)
class StageFileRef:
    """A stage file the orchestrator delivered to the host's cache: found there
    by its key (never by a path from the wire) and used only when its sidecar
    says it holds exactly ``size`` bytes of digest ``digest``."""

    key: StageKey
    size: int
    digest: str


# ------------------------------------------------------- stage files

_LABEL = re.compile(r"[^A-Za-z0-9_-]+")
_HEX = re.compile(r"^[0-9a-f]{64}$")


def label_for(name: str) -> str:
    """A model name as a safe file-name part (what a sender's label becomes)."""
    label = _LABEL.sub("-", name).strip("-")[:40]
    return label or "model"


@dataclass(frozen=True, slots=True)
class StageKey:
    """Which stage file: chosen by whoever knows the model (a local writer, or
    the sender of a transfer) from the model's identity; the receiving host
    derives the file name from it and never takes a path from the wire."""

    model: str  # ModelIdentity.digest: 64 hex digits
    label: str  # the model's name, for people reading the cache
    start: int
    end: int
    block_count: int
    stage_format: int

    def check(self) -> None:
        """Refuse a key that could not have come from a model (wire input)."""
        if not _HEX.match(self.model):
            raise CacheError(f"stage key: model digest {self.model!r} is not 64 hex digits")
        if not 0 <= self.start < self.end <= self.block_count < 1 << 20:
            raise CacheError(
                f"stage key: layers [{self.start}, {self.end}) of {self.block_count} blocks is no range"
            )
        if not 0 < self.stage_format < 1 << 16:
            raise CacheError(f"stage key: stage format {self.stage_format} is not valid")

    @property
    def digest(self) -> str:
        text = f"{self.model}|{self.start}|{self.end}|{self.block_count}|{self.stage_format}"
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    @property
    def file_name(self) -> str:
        label = label_for(self.label)
        return f"{label}.blk{self.start}-{self.end}of{self.block_count}.{self.digest}.gguf"


# --------------------------------------------------- the model identity


@dataclass(frozen=True, slots=True)
class MetadataDigest:
    key: str
    digest: str  # of the value's type and encoded bytes (16 hex digits)
    preview: str  # a short rendering of the value, for messages


@dataclass(frozen=True, slots=True)
class TensorSignature:
    name: str
    shape: tuple[int, ...]  # ggml order (ne[0] first)
    ggml_type: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What is compared between hosts (see the module docstring for what is
    not). ``digest`` alone decides sameness; the entries explain a mismatch."""

    digest: str  # sha256 over metadata_digest and tensors_digest
    metadata_digest: str  # sha256 over every (key, value digest), keys sorted
    tensors_digest: str  # sha256 over every tensor signature, names sorted
    name: str  # general.name, for messages
    metadata: tuple[MetadataDigest, ...]  # sorted by key
    tensors: tuple[TensorSignature, ...]  # sorted by name

    def compact(self) -> ModelIdentity:
        """The same identity without its entries (a few hundred bytes): enough
        to tell same from different, not to say what differs."""
        return ModelIdentity(self.digest, self.metadata_digest, self.tensors_digest, self.name, (), ())
