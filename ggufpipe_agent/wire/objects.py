"""Object records: the token and activation objects that travel on edges.

A record is a fixed 44-byte little-endian header followed by raw payload bytes::

    magic  b"GPOB"     4s
    version            u8
    flags              u8   bit 0 (MORE): another part of this object's sequence follows;
                            bit 1 (REBUILD): rows a rebuilt stage computes and sends no further
    kind               u8   1 tokens, 2 activation
    dtype              u8   1 int32, 2 float32, 3 float16
    run_id             u64
    edge_id            u32
    sequence           u32  the object's place in its edge's stream (0: the prompt)
    position           u32  the sequence position of the object's first row
    rows               u32  tokens in the object
    cols               u32  1 for tokens, hidden_dim for activations
    nbytes             u64  payload length == rows * cols * itemsize

Version 2 split version 1's u64 sequence into a u32 sequence and a u32
position, so the header is still 44 bytes. Version 3 split version 2's u16
version into a u8 version and a u8 of flags: a prompt travels between stages
in parts (a chunk of rows each, as soon as a stage has computed it), every
part but the last flagged MORE, so the next stage starts on the first chunk
while this one computes the second and the last stage samples only after
the last (docs/protocol.md, "Prompt parts"). Positions travel in-band because a
run may start after a prefix its stages kept from the previous run: the
prompt object says where it starts, and every object after it says where it
is, so a stage never guesses (docs/protocol.md, docs/worker.md). A part
flagged REBUILD (with MORE) is a step of an interrupted run that a restarted
stage computes again into its cache, in the shape it first had, and sends no
further: the stages after it still hold it (docs/recovery.md, "Replay in
proportion").

This is the only module that turns payload bytes into arrays. The relay in the
orchestrator reads headers only and forwards payloads untouched.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ggufpipe_agent.errors import ProtocolError
from ggufpipe_agent.ids import EdgeId, RunId
from ggufpipe_agent.wire.protocol import ObjectSpec

OBJECT_MAGIC = b"GPOB"
OBJECT_VERSION = 3
_HEADER = struct.Struct("<4sBBBBQIIIIIQ")
#: The flag of a part of a sequence that another part follows.
FLAG_MORE = 1
#: The flag of a part a rebuilt stage computes and does not send on.
FLAG_REBUILD = 2
HEADER_SIZE = _HEADER.size

#: Bound on any payload before an edge's own max_extent is known.
ABSOLUTE_MAX_PAYLOAD = 1 << 31

KIND_TOKENS = 1
KIND_ACTIVATION = 2
KIND_NAMES = {KIND_TOKENS: "tokens", KIND_ACTIVATION: "activation"}
KIND_CODES = {name: code for code, name in KIND_NAMES.items()}

DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<i4"),
    2: np.dtype("<f4"),
    3: np.dtype("<f2"),
}
DTYPE_NAMES = {1: "int32", 2: "float32", 3: "float16"}
DTYPE_CODES = {name: code for code, name in DTYPE_NAMES.items()}


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    kind: int
    dtype: int
    run_id: RunId
    edge_id: EdgeId
    sequence: int
    rows: int
    cols: int
    nbytes: int
    # Last among the fields so that records built by position keep their
    # meaning; 0 is the start of the sequence.
    position: int = 0
    #: Another part of this sequence follows (a prompt's chunk but its last).
    more: bool = False
    #: A step of an interrupted run computed again by a rebuilt stage, not sent on.
    rebuild: bool = False

    def pack(self) -> bytes:
        return _HEADER.pack(
            OBJECT_MAGIC,
            OBJECT_VERSION,
            (FLAG_MORE if self.more else 0) | (FLAG_REBUILD if self.rebuild else 0),
            self.kind,
            self.dtype,
            self.run_id,
            self.edge_id,
            self.sequence,
            self.position,
            self.rows,
            self.cols,
            self.nbytes,
        )

    @property
    def kind_name(self) -> str:
        return KIND_NAMES[self.kind]

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def describe(self) -> str:
        part = " (a part, more follow)" if self.more else ""
        if self.rebuild:
            part += " (to rebuild a cache)"
        return (
            f"{self.kind_name} object seq {self.sequence}{part} at position {self.position} "
            f"on edge {self.edge_id} "
            f"({self.rows}x{self.cols} {self.dtype_name}, {self.nbytes} bytes)"
        )


def unpack_header(data: bytes, max_payload: int) -> ObjectHeader:
    """Parse and sanity-check a header; ``max_payload`` bounds ``nbytes``.

    Everything checked here is checked before any payload byte is read, so a
    corrupt or hostile length can never make a reader allocate or wait for it.
    """
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"truncated object header ({len(data)} of {HEADER_SIZE} bytes)")
    (magic, version, flags, kind, dtype, run_id, edge_id, sequence, position, rows, cols, nbytes) = (
        _HEADER.unpack(data)
    )
    if magic != OBJECT_MAGIC:
        raise ProtocolError(f"bad object magic {magic!r}")
    if version != OBJECT_VERSION:
        raise ProtocolError(f"object record version {version}, this side speaks {OBJECT_VERSION}")
    if flags & ~(FLAG_MORE | FLAG_REBUILD):
        raise ProtocolError(f"unknown object flags {flags:#x}")
    if kind not in KIND_NAMES:
        raise ProtocolError(f"unknown object kind {kind}")
    if dtype not in DTYPES:
        raise ProtocolError(f"unknown object dtype {dtype}")
    if nbytes > max_payload:
        raise ProtocolError(f"object of {nbytes} bytes exceeds the limit of {max_payload}")
    if nbytes != rows * cols * DTYPES[dtype].itemsize:
        raise ProtocolError(f"object says {rows}x{cols} {DTYPE_NAMES[dtype]} but {nbytes} payload bytes")
    more, rebuild = bool(flags & FLAG_MORE), bool(flags & FLAG_REBUILD)
    return ObjectHeader(kind, dtype, run_id, edge_id, sequence, rows, cols, nbytes, position, more, rebuild)


def check_spec(header: ObjectHeader, spec: ObjectSpec) -> None:
    """Refuse an object that does not match its edge's object spec (docs/design.md, "Object records")."""
    if header.kind_name != spec.kind:
        raise ProtocolError(f"{header.describe()}: edge carries {spec.kind} objects")
    if header.dtype_name != spec.dtype:
        raise ProtocolError(f"{header.describe()}: edge carries {spec.dtype}")
    if header.cols != spec.width:
        raise ProtocolError(f"{header.describe()}: edge carries rows of width {spec.width}")
    if header.rows == 0 or header.rows > spec.max_rows:
        raise ProtocolError(f"{header.describe()}: rows must be 1..{spec.max_rows}")
    if header.nbytes > spec.max_extent:
        raise ProtocolError(f"{header.describe()}: exceeds max_extent {spec.max_extent}")


def token_out_width(logprobs: int) -> int:
    """Words in each token-out record: the token alone, or (``logprobs`` >= 0)
    the token, its logprob and ``logprobs`` (id, logprob) pairs, logprobs as
    float32 bits (ggufpipe_agent/llama/sampler.py, logprob_payload)."""
    return 1 if logprobs < 0 else 2 + 2 * logprobs


def sample_record(
    run_id: RunId, edge_id: EdgeId, sequence: int, words: np.ndarray, *, position: int = 0
) -> bytes:
    """One sampled token with its logprobs: one row of ``len(words)`` int32 words."""
    payload = np.ascontiguousarray(words, dtype="<i4").tobytes()
    header = ObjectHeader(
        KIND_TOKENS, DTYPE_CODES["int32"], run_id, edge_id, sequence, 1, len(words), len(payload), position
    )
    return header.pack() + payload


def read_logprobs(words: list[int]) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """The token, its logprob and its (id, logprob) alternatives from a
    token-out record of :func:`token_out_width` words."""
    array = np.asarray(words, dtype="<i4")
    floats = array.view("<f4")
    pairs = tuple((int(array[i]), float(floats[i + 1])) for i in range(2, len(array) - 1, 2))
    return int(array[0]), float(floats[1]), pairs


def tokens_record(
    run_id: RunId,
    edge_id: EdgeId,
    sequence: int,
    tokens: list[int],
    *,
    position: int = 0,
    more: bool = False,
    rebuild: bool = False,
) -> bytes:
    payload = np.asarray(tokens, dtype="<i4").tobytes()
    header = ObjectHeader(
        KIND_TOKENS,
        DTYPE_CODES["int32"],
        run_id,
        edge_id,
        sequence,
        len(tokens),
        1,
        len(payload),
        position,
        more,
        rebuild,
    )
    return header.pack() + payload


def activation_record(
    run_id: RunId,
    edge_id: EdgeId,
    sequence: int,
    rows: np.ndarray,
    dtype: str,
    *,
    position: int = 0,
    more: bool = False,
) -> tuple[bytes, memoryview]:
    """Header and payload (no concatenation copy) for ``rows`` of shape [n, hidden]."""
    code = DTYPE_CODES[dtype]
    array = np.ascontiguousarray(rows, dtype=DTYPES[code])
    n, width = array.shape
    header = ObjectHeader(
        KIND_ACTIVATION, code, run_id, edge_id, sequence, n, width, array.nbytes, position, more
    )
    return header.pack(), array.data.cast("B")


def decode_tokens(header: ObjectHeader, payload: bytes | bytearray | memoryview) -> list[int]:
    if header.kind != KIND_TOKENS:
        raise ProtocolError(f"{header.describe()}: expected a tokens object")
    return np.frombuffer(payload, dtype=DTYPES[header.dtype]).tolist()


def decode_activation(header: ObjectHeader, payload: bytes | bytearray | memoryview) -> np.ndarray:
    """float32 rows [n, hidden]; float16 payloads are widened (exactly)."""
    if header.kind != KIND_ACTIVATION:
        raise ProtocolError(f"{header.describe()}: expected an activation object")
    array = np.frombuffer(payload, dtype=DTYPES[header.dtype]).reshape(header.rows, header.cols)
    if array.dtype != np.float32:
        array = array.astype(np.float32)
    return array
