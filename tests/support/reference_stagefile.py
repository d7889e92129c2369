"""The stage file as gguf.GGUFWriter writes it: the reference the streamed
producer (ggufpipe_agent.stagefiles.stream) is compared with, byte for byte.

This is the writer ggufpipe used before the stream (stage format 3), kept
here as an oracle built on the ``gguf`` package's own reader and writer:
every metadata field copied through ``GGUFReader.fields`` (per-layer arrays
sliced, ``split.*`` dropped), the architecture's overrides appended, the
tensors of the range renumbered. It parses the whole vocabulary, which is
why it is slow (benchmarks/bench_stagefile.py measures both).
"""

from __future__ import annotations

import re
from pathlib import Path

from ggufpipe_agent.gguf.architectures import stage_metadata_overrides
from ggufpipe_agent.gguf.files import read_model_files

_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.*)$")


def write_reference_stage_file(source: Path, start: int, end: int, destination: Path) -> Path:
    import gguf

    files = read_model_files(source)
    arch = files.architecture
    block_count = int(files.get(f"{arch}.block_count"))
    overrides = stage_metadata_overrides(arch, files.get, start, end)
    readers = [gguf.GGUFReader(part.path, "r") for part in files.parts]
    writer = gguf.GGUFWriter(destination, arch=arch, endianess=readers[0].endianess)
    for field in readers[0].fields.values():
        name = field.name
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture" or name in overrides:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if name == f"{arch}.block_count":
            value = end - start
        elif (
            name.startswith(f"{arch}.")
            and value_type == gguf.GGUFValueType.ARRAY
            and len(field.data) == block_count
        ):
            value = value[start:end]
        elif name == "general.alignment":
            writer.data_alignment = int(value)
        writer.add_key_value(name, value, value_type, sub_type=sub_type)
    for name, (value, value_type, sub_type) in overrides.items():
        writer.add_key_value(name, value, value_type, sub_type=sub_type)
    chosen = []
    for reader in readers:
        for tensor in reader.tensors:
            match = _BLOCK_TENSOR.match(tensor.name)
            if match:
                index = int(match.group(1))
                if not start <= index < end:
                    continue
                name = f"blk.{index - start}.{match.group(2)}"
            elif tensor.name == "output.weight" and end != block_count:
                continue
            else:
                name = tensor.name
            chosen.append(tensor)
            writer.add_tensor_info(
                name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in chosen:
        writer.write_tensor_data(tensor.data, tensor_endianess=readers[0].endianess)
    writer.close()
    return destination
