"""The w4a8 engine reads a GGUF header as data, not trust: a file whose counts, dimensions,
alignment or nesting do not fit its bytes or each other is refused at load with one line naming
the field or the tensor, before any kernel touches it (never a signal, never a traceback), and
``auto`` then picks another engine. The control: the intact file loads and serves."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from shared.engines import resolve
from shared.engines.w4a8.gguf_file import MappedGGUF
from shared.engines.w4a8.model import GGUFFile, W4A8Decoder
from shared.models.catalog import ModelSpecError
from tests.support.fixed_gguf import write_fixed_gguf

# what is edited -> what the refusal names
EDITS = {
    "embedding_length 128 for tensors 256 wide": ({"embedding_length": 128}, {},
                                                  "embedding_length"),
    "feed_forward_length 1024 for FFN tensors of 512": ({"feed_forward_length": 1024}, {},
                                                        "ffn_gate"),
    "head_count_kv 0": ({"head_count_kv": 0}, {}, "head_count_kv"),
    "head_count 3 for a width of 256": ({"head_count": 3}, {}, "head_count"),
    "head_count_kv 3 over 4 heads": ({"head_count_kv": 3}, {}, "head_count_kv"),
    "an RMSNorm of 128 values": ({}, {"output_norm.weight": 128}, "output_norm.weight"),
    "an output head of 128 rows for 256 ids": ({}, {"output.weight": 128}, "output.weight"),
    "a key projection of 64 rows": ({}, {"blk.1.attn_k.weight": 64}, "blk.1.attn_k.weight"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_header_that_does_not_fit_its_tensors_is_refused_in_one_line(edit: str,
                                                                       tmp_path: Path) -> None:
    fields, widths, named = EDITS[edit]
    path = write_fixed_gguf(tmp_path / "edited.gguf", fields=fields, widths=widths)
    with pytest.raises(ModelSpecError) as error:
        W4A8Decoder(GGUFFile(path), num_slots=1, slot_tokens=16)
    message = str(error.value)
    assert "\n" not in message and named in message, message
    assert resolve("auto", str(path), "cpu").name != "w4a8"


def patched(path: Path, key: str, value: int, fmt: str = "<I") -> Path:
    """``path`` with the scalar metadata ``key`` (of GGUF type u32) set to ``value``."""
    data = bytearray(path.read_bytes())
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", data, at)[0] == 4  # u32
    struct.pack_into(fmt, data, at + 4, value)
    out = path.with_name(f"{key}-{value}.gguf")
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("value", [0, 3, 1 << 31, (1 << 32) - 1])
def test_an_alignment_that_is_not_a_power_of_two_is_refused(value: int, tmp_path: Path) -> None:
    import gguf

    plain = tmp_path / "aligned.gguf"
    writer = gguf.GGUFWriter(str(plain), "llama")
    writer.add_uint32("general.alignment", 32)
    writer.add_tensor("x", __import__("numpy").ones(8, dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert MappedGGUF(plain).tensors["x"].shape == (8,)  # the control: intact, it reads
    with pytest.raises(ModelSpecError, match="general.alignment") as error:
        MappedGGUF(patched(plain, "general.alignment", value))
    assert "\n" not in str(error.value)


def test_metadata_nested_5000_deep_is_refused(tmp_path: Path) -> None:
    key = b"deep"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    body = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 0, 0)
    path = tmp_path / "deep.gguf"
    path.write_bytes(header + body)
    with pytest.raises(ModelSpecError, match="nested") as error:
        MappedGGUF(path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dims", [(0, 256), (256, 1 << 62), (1 << 33, 1 << 33)])
def test_a_dimension_of_zero_or_one_whose_product_wraps_is_refused(dims: tuple[int, int],
                                                                   tmp_path: Path) -> None:
    name = b"t"
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", len(name)) + name
    header += struct.pack("<I", 2) + struct.pack("<QQ", *dims) + struct.pack("<IQ", 0, 0)
    path = tmp_path / "dims.gguf"
    path.write_bytes(header + bytes(64))
    with pytest.raises(ModelSpecError, match="tensor t") as error:
        MappedGGUF(path)
    assert "\n" not in str(error.value)


def test_the_intact_file_loads(tmp_path: Path) -> None:
    path = write_fixed_gguf(tmp_path / "intact.gguf")
    assert W4A8Decoder(GGUFFile(path), num_slots=1, slot_tokens=16).shape.hidden == 256


# -- non-finite weights, a file that changes under the verifier ----------------------------------

def scale_edited(path: Path, tensor: str, block: int, where: int, value: float) -> Path:
    """``path`` with the fp16 scale at byte ``where`` of block ``block`` of ``tensor`` set."""
    mapped = MappedGGUF(path)
    info = mapped.tensors[tensor]
    size = {12: 144, 14: 210}[info.type]
    data = bytearray(path.read_bytes())
    struct.pack_into("<e", data, info.offset + block * size + where, value)
    out = path.with_name(f"{tensor}-{block}-{where}.gguf")
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(("tensor", "where", "value"), [
    ("token_embd.weight", 0, float("nan")), ("token_embd.weight", 2, float("inf")),
    ("output.weight", 208, float("-inf")), ("blk.0.ffn_down.weight", 0, float("nan"))])
def test_a_block_scale_that_is_not_finite_is_refused_naming_the_tensor(
        tensor: str, where: int, value: float, tmp_path: Path) -> None:
    path = write_fixed_gguf(tmp_path / "intact.gguf")
    info = MappedGGUF(path).tensors[tensor]
    if info.type == 14 and where != 208:
        where = 208  # a Q6_K block's d is its last 2 bytes
    edited = scale_edited(path, tensor, 3, where, value)
    with pytest.raises(ModelSpecError, match=f"{tensor} has 1 block scales that are not finite"):
        W4A8Decoder(GGUFFile(edited), num_slots=1, slot_tokens=16)
    # control: a finite scale at the same place loads
    W4A8Decoder(GGUFFile(scale_edited(path, tensor, 3, where, 0.5)), num_slots=1,
                slot_tokens=16)


def test_a_file_changed_under_the_engine_stops_it_before_the_mapping_is_read(
        tmp_path: Path) -> None:
    from shared.engines.int8.model import Rows
    from shared.engines.target import EngineLost

    path = write_fixed_gguf(tmp_path / "served.gguf")
    decoder = W4A8Decoder(GGUFFile(path), num_slots=1, slot_tokens=16)
    import torch

    rows = Rows(torch.tensor([3, 4]), [0, 0], [0, 1])
    decoder.forward(rows, torch.tensor([1]))  # the control: it serves
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(4096)
    with pytest.raises(EngineLost, match=rf"changed under the verifier \(size {size} -> 4096"):
        decoder.forward(rows, torch.tensor([1]))


@pytest.mark.slow  # a verifier process starts
def test_a_verifier_whose_file_is_truncated_answers_503_and_ends_in_one_line(
        q4k: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    import httpx

    from verifier_service.launch import VerifierProcess
    from verifier_service.scheduling.scheduler import ENGINE_LOST_EXIT

    folder = shutil.copytree(q4k["target"].parent, tmp_path / "served")
    path = folder / q4k["target"].name
    log = tmp_path / "verifier.log"
    with VerifierProcess(["--model", str(path), "--engine", "w4a8", "--max-context", "64"],
                         log_path=log) as verifier:
        body = {"prompt_ids": [3, 4, 5], "max_new_tokens": 4}
        assert httpx.post(f"{verifier.url}/v1/generate", json=body, timeout=60).status_code \
            == 200  # the control: it serves
        with open(path, "r+b") as handle:
            handle.truncate(4096)
        answer = httpx.post(f"{verifier.url}/v1/generate", json=body, timeout=60)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "engine_lost"
        assert verifier.proc is not None
        assert verifier.proc.wait(timeout=30) == ENGINE_LOST_EXIT
    text = log.read_text()
    assert len([line for line in text.splitlines() if "changed under the verifier" in line]) \
        == 1, text[-2000:]
    assert "Bus error" not in text and "Traceback" not in text, text[-2000:]
