"""What the GGUF quantizers of bench/peers share: a writer with the source's metadata (its file
type replaced), and a tensor's values as float32 rows. Needs gguf-py on PYTHONPATH."""
import gguf
import numpy as np

FLOATS = (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.BF16)


def writer_like(reader, dst, file_type):
    """A GGUFWriter for `dst` with every metadata field of `reader`, general.file_type set to
    `file_type`."""
    w = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            w.add_uint32(name, file_type)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    return w


def float_rows(t):
    """A 2-D F16 / F32 / BF16 tensor's values as float32 [rows, cols], or None for any other."""
    shape = [int(v) for v in reversed(t.shape.tolist())]  # rows first
    if len(shape) != 2 or t.tensor_type not in FLOATS:
        return None
    data = np.array(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return data.astype(np.float32).reshape(shape)
