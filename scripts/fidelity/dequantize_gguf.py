#!/usr/bin/env python3
"""Writes a copy of a GGUF model with every tensor stored as F32.

The cross-check uses it to compare tinyllm and llama.cpp in plain float
arithmetic: with quantised weights llama.cpp also rounds activations to 8
bits, which makes this small model's predictions flip on one-ulp
differences (docs/fidelity.md). Values are those of the quantised weights,
dequantised, so both engines read identical floats.
"""
import sys

import numpy as np
import gguf


def main(src, dst):
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # header pseudo-fields; the writer adds the architecture itself
        if field.name == "general.file_type":
            writer.add_key_value(field.name, int(gguf.LlamaFileType.ALL_F32), gguf.GGUFValueType.UINT32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape.tolist())]),
                          raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
