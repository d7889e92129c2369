"""Model identity: what two hosts compare, and the one sentence saying what differs."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ggufpipe_agent.gguf.header import LongArray, read_header
from ggufpipe_agent.gguf.identity import describe_difference, model_identity
from tests.support import synthetic
from tests.support.bulky_gguf import write_out

BLOCKS = 4


def tiny(
    path: Path,
    name: str = "tiny",
    half: tuple[int, ...] = (),
    wide: tuple[int, ...] = (),
    extra: dict[str, float] | None = None,
    output: bool = True,
) -> Path:
    """A small llama-shaped GGUF (identities read headers only): blocks in
    ``half`` have an F16 attn_q, blocks in ``wide`` a wider one."""
    import gguf

    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_name(name)
    writer.add_uint32("llama.block_count", BLOCKS)
    writer.add_uint32("llama.embedding_length", 8)
    writer.add_uint32("llama.attention.head_count", 2)
    for key, value in (extra or {}).items():
        writer.add_float32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    for block in range(BLOCKS):
        dtype = np.float16 if block in half else np.float32
        columns = 16 if block in wide else 8
        writer.add_tensor(f"blk.{block}.attn_q.weight", np.zeros((8, columns), dtype=dtype))
    if output:
        writer.add_tensor("output.weight", np.zeros((16, 8), dtype=np.float32))
    write_out(writer)
    return path


def difference(tmp_path: Path, **changes: object) -> str:
    base = model_identity(tiny(tmp_path / "a.gguf"))
    other = model_identity(tiny(tmp_path / "b.gguf", **changes))  # type: ignore[arg-type]
    return describe_difference(base, other)


def test_the_same_model_is_the_same_wherever_it_lies(tmp_path):
    first = tiny(tmp_path / "a.gguf")
    copy = Path(shutil.copy(first, tmp_path / "elsewhere.gguf"))
    assert model_identity(first) == model_identity(copy)
    assert describe_difference(model_identity(first), model_identity(copy)) == ""
    assert len(model_identity(first).digest) == 64


@pytest.mark.parametrize(
    ("changes", "sentence"),
    [
        ({"name": "other"}, "metadata general.name differs ('tiny' vs 'other')"),
        ({"extra": {"llama.rope.freq_base": 1e6}}, "metadata llama.rope.freq_base only in the second"),
        ({"half": (3,)}, "tensor blk.3.attn_q.weight: type F32 vs F16"),
        ({"wide": (2,)}, "tensor blk.2.attn_q.weight: shape [8, 8] vs [16, 8]"),
        ({"output": False}, "tensor output.weight only in the first"),
        (
            {"half": (0, 1, 2, 3)},
            "4 tensors differ, first tensor blk.0.attn_q.weight: type F32 vs F16",
        ),
        (
            {"name": "other", "half": (1,)},
            "metadata general.name differs ('tiny' vs 'other'); tensor blk.1.attn_q.weight: type F32 vs F16",
        ),
    ],
)
def test_what_differs_in_one_sentence(tmp_path, changes, sentence):
    assert difference(tmp_path, **changes) == sentence


def test_blocks_are_named_in_numeric_order(tmp_path):
    import gguf

    def model(path: Path, half: bool) -> Path:
        writer = gguf.GGUFWriter(path, arch="llama")
        writer.add_uint32("llama.block_count", 12)
        for block in (10, 2):
            writer.add_tensor(f"blk.{block}.w", np.zeros(4, dtype=np.float16 if half else np.float32))
        write_out(writer)
        return path

    sentence = describe_difference(
        model_identity(model(tmp_path / "a.gguf", False)), model_identity(model(tmp_path / "b.gguf", True))
    )
    assert sentence.startswith("2 tensors differ, first tensor blk.2.w")


def test_a_compact_identity_tells_same_from_different(tmp_path):
    a = model_identity(tiny(tmp_path / "a.gguf")).compact()
    b = model_identity(tiny(tmp_path / "b.gguf", name="other", half=(1,))).compact()
    assert a.metadata == () and a.tensors == ()
    assert describe_difference(a, a) == ""
    assert describe_difference(a, b) == "the metadata differs; the tensor table differs"


def test_a_change_deep_in_the_vocabulary_is_noticed(model_path, tmp_path):
    """The tokens array (49152 strings) is kept by the header reader as its
    length only; the identity hashes its bytes in the file."""
    header = read_header(model_path)
    assert isinstance(header.metadata["tokenizer.ggml.tokens"], LongArray)
    span = header.spans["tokenizer.ggml.tokens"]
    patched = tmp_path / "patched.gguf"
    data = bytearray(model_path.read_bytes())
    middle = (span.value + span.end) // 2
    data[middle] = data[middle] ^ 0x01  # one bit of one token string, same length
    patched.write_bytes(bytes(data))
    sentence = describe_difference(model_identity(model_path), model_identity(patched))
    assert sentence == "metadata tokenizer.ggml.tokens differs"


def test_tensor_data_is_not_compared(tmp_path):
    """Documented limit: two files that differ only in weights are one identity
    (the stage-file digests tell them apart: tests/test_stagecache.py)."""
    first = synthetic.write_model(tmp_path / "a.gguf", "llama", seed=0)
    second = synthetic.write_model(tmp_path / "b.gguf", "llama", seed=1)
    assert first.read_bytes() != second.read_bytes()
    assert model_identity(first) == model_identity(second)
