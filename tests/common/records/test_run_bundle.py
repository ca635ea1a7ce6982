"""Run bundles: written with a manifest of sha256s, refused naming the file when anything was altered."""
from __future__ import annotations

import json

import pytest

from services.common.records.run_bundle import (
    DOCUMENTS,
    MANIFEST,
    BundleError,
    documents_from_upload,
    load_bundle,
    record_name,
    verify_bundle,
    write_bundle,
)


def documents(status: str = "completed") -> dict:
    return {
        "run.json": {"id": "0123456789ab", "name": "r", "status": status, "step": 2, "steps": 2,
                     "created_at": 1.0, "updated_at": 2.0, "error": ""},
        "spec.json": {"name": "r", "steps": 2},
        "fingerprint.json": {"trainer": {"platform": {"arch": "x86_64"}}},
        "metrics.json": {"eval_initial": None, "steps": [
            {"step": 1, "metrics": {"iw_mean": 1.0}, "timings": {"train": 0.5}},
            {"step": 2, "metrics": {"iw_mean": 0.99}, "timings": {"train": 0.4}}]},
        "events.json": [{"ts": 1.0, "event": "submitted"}],
        "checkpoint.json": {"step": 2, "path": "/elsewhere/step_000002"},
    }


def test_a_written_bundle_verifies_and_loads(tmp_path):
    out = tmp_path / "b"
    manifest = write_bundle(out, "0123456789ab", documents(), {1: b"record one"})
    assert set(manifest["files"]) == {*DOCUMENTS, record_name(1)}
    b = load_bundle(out)
    assert b.run["id"] == "0123456789ab" and b.metrics["steps"][1]["metrics"]["iw_mean"] == 0.99
    assert b.records == {1: out / record_name(1)}
    with pytest.raises(BundleError, match="not an empty directory"):
        write_bundle(out, "0123456789ab", documents(), {})


@pytest.mark.parametrize("name", ["metrics.json", record_name(1)])
def test_an_altered_file_is_refused_naming_it(tmp_path, name):
    out = tmp_path / "b"
    write_bundle(out, "0123456789ab", documents(), {1: b"record one"})
    data = bytearray((out / name).read_bytes())
    data[len(data) // 2] ^= 1
    (out / name).write_bytes(bytes(data))
    with pytest.raises(BundleError) as exc:
        verify_bundle(out)
    assert exc.value.field == name and "does not match the manifest" in str(exc.value)


def test_a_file_outside_the_manifest_or_a_foreign_name_is_refused(tmp_path):
    out = tmp_path / "b"
    write_bundle(out, "0123456789ab", documents(), {})
    (out / record_name(7)).write_bytes(b"smuggled")
    with pytest.raises(BundleError, match="not in the manifest"):
        verify_bundle(out)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"]["../../etc/passwd"] = {"sha256": "0" * 64, "bytes": 1}
    with pytest.raises(BundleError, match="no file of a run bundle"):
        documents_from_upload(manifest, {})


def test_an_upload_is_checked_against_the_manifest_and_for_an_ended_run(tmp_path):
    out = tmp_path / "b"
    manifest = write_bundle(out, "0123456789ab", documents(), {})
    files = {n: (out / n).read_text() for n in DOCUMENTS}
    assert documents_from_upload(manifest, files)["run.json"]["status"] == "completed"
    with pytest.raises(BundleError) as exc:
        documents_from_upload(manifest, {**files, "events.json": "[]\n"})
    assert exc.value.field == "events.json"
    running = tmp_path / "running"
    manifest = write_bundle(running, "0123456789ab", documents("running"), {})
    with pytest.raises(BundleError, match="status: 'running' has not ended"):
        documents_from_upload(manifest, {n: (running / n).read_text() for n in DOCUMENTS})
