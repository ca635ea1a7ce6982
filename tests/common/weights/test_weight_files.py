"""The shared-path weight file: written in the safetensors layout without a library's copy, read back
block by block into the tensors returned, every byte hashed once per side, every refusal naming its field.

safetensors' own safe_open is the reference reader of what write_weight_dir writes; the digest is checked
against its definition (recomputed here). Malformed files are made by hand from the layout's parts.
"""
from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from services.common.weights.files import (
    ORDER_KEY,
    VERSION_KEY,
    WEIGHTS_FILE,
    FiniteTensors,
    WeightFilesError,
    read_weight_dir,
    staging_plan,
    write_tensor_data,
    write_weight_dir,
)
from services.common.weights.safetensors_layout import encode_header
from tests.support.digest_reference import BLOCK, Sha256Counter, bytes_fed_once, digest_by_definition, digest_of_byte_strings, raw_bytes



def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        ("bf16_two_blocks", torch.randn(BLOCK // 2 + 999, generator=g).to(torch.bfloat16)),  # not a block multiple
        ("f32", torch.randn(17, 5, generator=g)),
        ("i64", torch.randint(-2**62, 2**62, (33,), generator=g, dtype=torch.int64)),
        ("empty", torch.empty(0, 4)),
        ("empty_bf16", torch.empty(3, 0, dtype=torch.bfloat16)),
        ("scalar", torch.tensor(2.5)),
        ("f16", torch.randn(7, generator=g).half()),
        ("mask", torch.tensor([True, False, True])),
        ("u8_exact_block", torch.randint(0, 256, (BLOCK,), generator=g, dtype=torch.uint8)),
    ]


@pytest.fixture
def base(tmp_path) -> Path:
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    (d / "model.safetensors").write_bytes(b"not copied")
    return d


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and raw_bytes(a) == raw_bytes(b)


def test_round_trip_is_bit_exact_for_safe_open_and_the_reader(tmp_path, base):
    weights = _weights()
    written = write_weight_dir(tmp_path / "v3", weights, 3, base_dir=base)
    assert written.total_sha256 == digest_by_definition(weights)
    assert written.nbytes == sum(len(raw_bytes(t)) for _, t in weights) and written.tensors == len(weights)
    assert sorted(p.name for p in written.directory.iterdir()) == ["config.json", WEIGHTS_FILE]
    with safe_open(str(written.directory / WEIGHTS_FILE), framework="pt") as f:
        assert f.metadata() == {VERSION_KEY: "3", ORDER_KEY: json.dumps([n for n, _ in weights])}
        assert sorted(f.keys()) == sorted(n for n, _ in weights)
        assert all(_same(f.get_tensor(n), t) for n, t in weights)
    tensors, read = read_weight_dir(written.directory, policy_version=3, expected_sha256=written.total_sha256)
    assert isinstance(tensors, FiniteTensors) and list(tensors) == [n for n, _ in weights]
    assert all(_same(tensors[n], t) for n, t in weights)
    assert (read.total_sha256, read.nbytes, read.tensors, read.policy_version) == (
        written.total_sha256, written.nbytes, written.tensors, 3)


def test_the_data_lies_in_stream_order_and_the_header_is_padded(tmp_path, base):
    weights = list(reversed(_weights()))
    written = write_weight_dir(tmp_path / "v1", weights, 1, base_dir=base)
    data = (written.directory / WEIGHTS_FILE).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0
    header = json.loads(data[8:8 + length])
    starts = [header[n]["data_offsets"][0] for n, _ in weights]
    assert starts == sorted(starts)
    assert data[8 + length:] == b"".join(raw_bytes(t) for _, t in weights)


def test_aliased_and_non_contiguous_tensors_are_written_as_their_values(tmp_path, base):
    embed = torch.randn(6, 4)
    weights = [("model.embed_tokens.weight", embed), ("lm_head.weight", embed), ("transposed", embed.t()),
               ("row", embed[2])]
    written = write_weight_dir(tmp_path / "v1", weights, 1, base_dir=base)
    assert written.total_sha256 == digest_by_definition(weights)
    tensors, _ = read_weight_dir(written.directory, policy_version=1, expected_sha256=written.total_sha256)
    assert all(_same(tensors[n], t) for n, t in weights)
    assert tensors["lm_head.weight"].data_ptr() != tensors["model.embed_tokens.weight"].data_ptr()


def test_staging_plan_cuts_whole_blocks_into_contiguous_buffers():
    sizes = [BLOCK + 5, 0, 3, 2 * BLOCK, 7]
    plan = staging_plan(sizes, 2 * BLOCK)
    assert all(sum(n for seg in buf for _, n in seg.blocks) <= 2 * BLOCK for buf in plan)
    flat = [(seg.tensor, seg.offset, seg.length) for buf in plan for seg in buf]
    covered: dict[int, int] = {}
    for tensor, offset, length in flat:
        assert covered.get(tensor, 0) == offset
        covered[tensor] = offset + length
    assert covered == dict(enumerate(sizes))
    for buf in plan:  # each buffer is one contiguous range of the file
        positions = [(seg.position, seg.length) for seg in buf]
        assert [p for p, _ in positions] == [sum(n for _, n in positions[:i]) for i in range(len(positions))]
    assert len(plan) == 3


def test_the_staged_writer_writes_and_hashes_what_the_direct_one_does(tmp_path):
    weights = _weights() + [("tail", torch.randn(3 * BLOCK // 4 + 1))]
    tensors = [t for _, t in weights]
    outputs = {}
    with ThreadPoolExecutor(3) as pool:
        for staged in (False, True):
            path = tmp_path / f"staged-{staged}.bin"
            with open(path, "wb", buffering=0) as f:
                # One block a buffer: more buffers than the ring holds, so the ring is reused.
                digests = write_tensor_data(f, tensors, pool, staged=staged, staging_bytes=BLOCK)
            outputs[staged] = (path.read_bytes(), [d.result() for d in digests])
    assert outputs[True] == outputs[False]
    assert outputs[True][0] == b"".join(raw_bytes(t) for t in tensors)
    assert hashlib.sha256(b"".join(outputs[True][1])).hexdigest() == digest_by_definition(weights)


def test_each_side_hashes_each_byte_once(tmp_path, base, monkeypatch):
    weights = _weights()
    once = bytes_fed_once([len(raw_bytes(t)) for _, t in weights])
    counted = Sha256Counter(monkeypatch)
    written = write_weight_dir(tmp_path / "v1", weights, 1, base_dir=base)
    assert counted.fed == once
    counted.fed = 0
    read_weight_dir(written.directory, policy_version=1, expected_sha256=written.total_sha256)
    assert counted.fed == once


# ----------------------------------------------------------- the writer refuses --


@pytest.mark.parametrize("weights, message", [
    ([], "need at least one"),
    ([("a", torch.ones(1)), ("a", torch.ones(1))], "each name once"),
    ([("c", torch.ones(2, dtype=torch.complex128))], r"tensors\['c'\].dtype: torch.complex128 has no safetensors"),
    ([("s", torch.eye(2).to_sparse())], r"tensors\['s'\]: a torch.sparse_coo tensor"),
    ([("__metadata__", torch.ones(1))], "is the layout's metadata key"),
], ids=["none", "duplicate", "dtype", "sparse", "metadata-name"])
def test_the_writer_refuses_what_it_cannot_write_and_leaves_nothing(tmp_path, base, weights, message):
    with pytest.raises(WeightFilesError, match=message):
        write_weight_dir(tmp_path / "w" / "v1", weights, 1, base_dir=base)
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())


def test_the_writer_refuses_an_existing_directory(tmp_path, base):
    (tmp_path / "v1").mkdir()
    with pytest.raises(WeightFilesError, match="already exists"):
        write_weight_dir(tmp_path / "v1", [("a", torch.ones(1))], 1, base_dir=base)


# ----------------------------------------------------------- the reader refuses --


def _good_parts() -> tuple[dict, bytes]:
    header_bytes, _ = encode_header([("a", torch.float32, (2,)), ("b", torch.int64, (1,))],
                                    {VERSION_KEY: "1", ORDER_KEY: json.dumps(["a", "b"])})
    header = json.loads(header_bytes[8:])
    return header, torch.tensor([1.0, 2.0]).numpy().tobytes() + torch.tensor([7]).numpy().tobytes()


def _write_file(directory: Path, header: dict | bytes, data: bytes, length: int | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (directory / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return directory


def _digest_of(data_a: bytes, data_b: bytes) -> str:
    return digest_of_byte_strings([data_a, data_b])


def test_a_hand_made_file_of_the_layout_is_read(tmp_path):
    header, data = _good_parts()
    directory = _write_file(tmp_path / "ok", header, data)
    tensors, files = read_weight_dir(directory, policy_version=1, expected_sha256=_digest_of(data[:8], data[8:]))
    assert tensors["a"].tolist() == [1.0, 2.0] and tensors["b"].tolist() == [7] and files.nbytes == 16


def _entry(header: dict, name: str, **fields) -> dict:
    return {**header, name: {**header[name], **fields}}


@pytest.mark.parametrize("make, message", [
    (lambda h, d: (b"{", d, None), "header: not JSON"),
    (lambda h, d: (b"[1, 2]", d, None), "header: not a JSON object"),
    (lambda h, d: (b"\xff\xfe{}", d, None), "header: not JSON"),
    (lambda h, d: (h, d, 10**9), r"header: length 1000000000 is not within the file"),
    (lambda h, d: (h, d, 0), "header: length 0"),
    (lambda h, d: ({**h, "__metadata__": {"k": 1}}, d, None), r"header.__metadata__: must map strings to strings"),
    (lambda h, d: (_entry(h, "a", dtype="F128"), d, None), r"header\['a'\].dtype: unknown dtype 'F128'"),
    (lambda h, d: (_entry(h, "a", shape=[2, -1]), d, None), r"header\['a'\].shape: \[2, -1\] is not a list"),
    (lambda h, d: (_entry(h, "a", shape=[3]), d, None), r"header\['a'\]: shape \[3\] of F32 is 12 bytes, its "
                                                          "data_offsets span 8"),
    (lambda h, d: (_entry(h, "a", data_offsets=[8, 0]), d, None), r"header\['a'\].data_offsets: \[8, 0\]"),
    (lambda h, d: (_entry(h, "b", data_offsets=[4, 12]), d, None), r"header\['b'\].data_offsets: starts at 4, "
                                                                     "overlaps the previous tensor"),
    (lambda h, d: (_entry(h, "b", data_offsets=[12, 20]), d + b"\0" * 4, None), r"header\['b'\].data_offsets: "
                                                                                  "starts at 12, leaves a gap"),
    (lambda h, d: (h, d + b"\0", None), "the tensors' data_offsets end at 16, the file holds 17 bytes"),
    (lambda h, d: (h, d[:-1], None), "the tensors' data_offsets end at 16, the file holds 15 bytes"),
    (lambda h, d: ({**h, "a": {"dtype": "F32", "shape": [2]}}, d, None), r"header\['a'\]: must be an object"),
], ids=["truncated-json", "array", "not-utf8", "length-beyond-file", "length-zero", "metadata-types", "dtype",
        "shape", "shape-bytes", "offsets-reversed", "overlap", "gap", "trailing-bytes", "truncated-data",
        "missing-field"])
def test_the_reader_refuses_a_malformed_file_naming_the_field(tmp_path, make, message):
    header, data, length = make(*_good_parts())
    directory = _write_file(tmp_path / "bad", header, data, length)
    with pytest.raises(WeightFilesError, match=message):
        read_weight_dir(directory, policy_version=1, expected_sha256="0" * 64)


def test_the_reader_refuses_a_file_shorter_than_its_length_field(tmp_path):
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / WEIGHTS_FILE).write_bytes(b"\x01\x02")
    with pytest.raises(WeightFilesError, match="header: the file ended after 2 of 8 bytes"):
        read_weight_dir(tmp_path / "short", policy_version=1, expected_sha256="0" * 64)


@pytest.mark.parametrize("metadata, message", [
    ({VERSION_KEY: "1"}, "is not a WriteWeights directory"),
    ({VERSION_KEY: "x", ORDER_KEY: '["a", "b"]'}, "is not a WriteWeights directory"),
    ({VERSION_KEY: "2", ORDER_KEY: '["a", "b"]'}, "holds version 2, not 1"),
    ({VERSION_KEY: "1", ORDER_KEY: '["a"]'}, "recorded tensor order does not name"),
    ({VERSION_KEY: "1", ORDER_KEY: '["a", "b", "a"]'}, "recorded tensor order does not name"),
    ({VERSION_KEY: "1", ORDER_KEY: '{"a": 1, "b": 2}'}, "recorded tensor order does not name"),
], ids=["no-order", "bad-version", "other-version", "order-short", "order-repeats", "order-not-list"])
def test_the_reader_refuses_metadata_that_disagrees(tmp_path, metadata, message):
    header, data = _good_parts()
    directory = _write_file(tmp_path / "meta", {**header, "__metadata__": metadata}, data)
    with pytest.raises(WeightFilesError, match=message):
        read_weight_dir(directory, policy_version=1, expected_sha256=_digest_of(data[:8], data[8:]))


def test_the_reader_refuses_a_missing_file_and_a_wrong_digest(tmp_path, base):
    with pytest.raises(WeightFilesError, match=r"no model.safetensors"):
        read_weight_dir(tmp_path, policy_version=1, expected_sha256="0" * 64)
    good = write_weight_dir(tmp_path / "good", _weights(), 1, base_dir=base)
    with pytest.raises(WeightFilesError, match=f"hash to {good.total_sha256}, not {'0' * 64}"):
        read_weight_dir(good.directory, policy_version=1, expected_sha256="0" * 64)


@pytest.mark.parametrize("spoiled", ["nan_bf16", "inf_f32"])
def test_non_finite_values_are_read_as_unchecked_tensors(tmp_path, base, spoiled):
    weights = [("ok", torch.ones(3)), ("ints", torch.tensor([-1, 2**40])),
               ("nan_bf16", torch.ones(BLOCK).to(torch.bfloat16)), ("inf_f32", torch.zeros(5))]
    spoil = dict(weights)[spoiled]
    spoil[-1 if spoiled == "nan_bf16" else 2] = float("nan") if spoiled == "nan_bf16" else float("-inf")
    written = write_weight_dir(tmp_path / "v1", weights, 1, base_dir=base)
    tensors, files = read_weight_dir(written.directory, policy_version=1, expected_sha256=written.total_sha256)
    assert type(tensors) is dict and files.total_sha256 == written.total_sha256
    assert all(_same(tensors[n], t) for n, t in weights)


def test_a_floating_dtype_the_byte_check_does_not_know_is_left_to_the_engine(tmp_path, base):
    weights = [("f8", torch.randn(9).to(torch.float8_e4m3fn)), ("ok", torch.ones(2))]
    written = write_weight_dir(tmp_path / "v1", weights, 1, base_dir=base)
    tensors, _ = read_weight_dir(written.directory, policy_version=1, expected_sha256=written.total_sha256)
    assert type(tensors) is dict and all(_same(tensors[n], t) for n, t in weights)


def test_tensors_are_read_into_the_memory_allocate_gives(tmp_path, base):
    from services.rollout.weights.staging_arena import StagingArena

    weights = _weights()
    written = write_weight_dir(tmp_path / "v1", weights, 1, base_dir=base)
    arena = StagingArena(pin_memory=False)
    for _ in range(2):  # the second lease starts with a buffer the size the first one needed
        with arena.lease() as lease:
            tensors, files = read_weight_dir(written.directory, policy_version=1,
                                             expected_sha256=written.total_sha256, allocate=lease.allocate)
            assert isinstance(tensors, FiniteTensors) and files.total_sha256 == written.total_sha256
            assert all(_same(tensors[n], t) for n, t in weights)
            inside = [arena._buffer.data_ptr() <= tensors[n].data_ptr() < arena._buffer.data_ptr() + arena.capacity
                      for n, t in weights if t.numel()]
    assert all(inside) and arena.capacity >= written.nbytes
