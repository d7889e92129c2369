"""Write llama.cpp split sets for tests, with the ``gguf`` package's own
writer (``GGUFWriter(split_max_tensors=...)``, which names and keys the parts
as llama.cpp's gguf-split does: ``PREFIX-00001-of-0000N.gguf``, ``split.no``,
``split.count``, ``split.tensors.count``)."""

from __future__ import annotations

from pathlib import Path


def write_split_set(source: Path, directory: Path, stem: str, max_tensors: int) -> list[Path]:
    """Copy the GGUF ``source`` into a split set ``directory/stem-0000k-of-0000n.gguf``
    of at most ``max_tensors`` tensors per part; returns the parts in order."""
    import gguf

    reader = gguf.GGUFReader(source, "r")
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(directory / f"{stem}.gguf", arch=arch, split_max_tensors=max_tensors)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    parts = sorted(directory.glob(f"{stem}-*-of-*.gguf"))
    assert parts, "the writer made no split set (too few tensors for max_tensors?)"
    return parts
