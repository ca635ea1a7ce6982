"""Reading a W&B offline run file (`run-<id>.wandb`) in tests, as `wandb sync` reads it.

wandb 0.31 reads these files in its Go core only, so the format is read here: a 7-byte header
(":W&B", magic 0xBEE1, version 0), then LevelDB's log format (32 KiB blocks of records, each a 7-byte
header of masked CRC32-C, length and type FULL/FIRST/MIDDLE/LAST) whose payloads are serialized
`wandb_internal_pb2.Record` messages, the protobuf schema the wandb package ships.
"""
from __future__ import annotations

import struct
from pathlib import Path

HEADER = b":W&B\xe1\xbe\x00"
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    assert data[:len(HEADER)] == HEADER, f"{path}: not a W&B run file"
    out, pending, pos = [], b"", len(HEADER)
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if length == 0 and kind == 0:
            pos += left  # zero padding
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
            pending = b""
        else:
            raise AssertionError(f"{path}: record type {kind} at byte {pos}")
    return out


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as wpb

    out = []
    for payload in payloads(path):
        record = wpb.Record()
        record.ParseFromString(payload)
        out.append(record)
    return out


def history(path: Path) -> dict[int, dict[str, str]]:
    """step -> {key: value as the JSON text W&B stored} of every logged history row."""
    out: dict[int, dict[str, str]] = {}
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {(item.key or "/".join(item.nested_key)): item.value_json for item in record.history.item}
        step = record.history.step.num if record.history.HasField("step") else int(row["_step"])
        out.setdefault(step, {}).update(row)
    return out


def config(path: Path) -> dict[str, str]:
    """key -> JSON text of every config update."""
    out: dict[str, str] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                out[item.key or "/".join(item.nested_key)] = item.value_json
    return out
