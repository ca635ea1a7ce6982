"""A portable run bundle: a directory holding one run's record, spec, fingerprint, metrics, events and
recorded step inputs, with a manifest of every file's sha256.

Layout (format FORMAT):

    manifest.json            {"format", "run_id", "files": {name: {"sha256", "bytes"}}}
    run.json                 the run record (id, name, status, step, steps, created_at, updated_at, error)
    spec.json                the spec as the coordinator stored it
    fingerprint.json         the platform fingerprint (null when the run never configured its services)
    metrics.json             {"eval_initial", "steps": [{"step", "metrics", "timings"}]}: step metrics with
                             their timings, and the eval reports (eval/<set>/avg@k, pass@k) inside them
    events.json              the run's events, oldest first
    checkpoint.json          the last checkpoint's step and its path on the exporting deployment (a
                             reference: the weights stay there), or null
    step_records/step_NNNNNN.pb   recorded step inputs (debug.record_trajectories), where they exist

Every check that refuses a bundle names the file. Writing and reading are here, pure apart from the
files themselves; the coordinator's import checks the same digests over what it is sent
(`documents_from_upload`).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common.bounded_json import loads_bounded

FORMAT = "lockstep-run-bundle/1"
MANIFEST = "manifest.json"
DOCUMENTS = ("run.json", "spec.json", "fingerprint.json", "metrics.json", "events.json", "checkpoint.json")
RECORD_DIR = "step_records"
RECORD_NAME = re.compile(r"^step_records/step_(\d{6})\.pb$")
ENDED = ("completed", "failed", "cancelled")
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024


class BundleError(ValueError):
    """A bundle refused: `field` names the file (or the part of it) and the message says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record_name(step: int) -> str:
    return f"{RECORD_DIR}/step_{step:06d}.pb"


def encode_document(value: object) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def write_bundle(out: Path, run_id: str, documents: Mapping[str, object], records: Mapping[int, bytes]) -> dict:
    """Write a bundle to `out` (absent or empty: an existing bundle is never overwritten); its manifest."""
    if set(documents) != set(DOCUMENTS):
        raise BundleError("(documents)", f"expected {sorted(DOCUMENTS)}, got {sorted(documents)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BundleError(str(out), "exists and is not an empty directory; choose a new --out")
    files = {name: encode_document(documents[name]) for name in DOCUMENTS}
    files.update({record_name(step): data for step, data in sorted(records.items())})
    (out / RECORD_DIR).mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    manifest = {"format": FORMAT, "run_id": run_id,
                "files": {name: {"sha256": sha256(data), "bytes": len(data)} for name, data in files.items()}}
    (out / MANIFEST).write_bytes(encode_document(manifest))
    return manifest


def check_manifest(manifest: object) -> dict[str, str]:
    """The manifest's {file name: sha256}, every name one the format allows."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(MANIFEST, f"not a {FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise BundleError(MANIFEST, "files: missing or not a mapping")
    digests = {}
    for name, entry in files.items():
        if name not in DOCUMENTS and not RECORD_NAME.match(str(name)):
            raise BundleError(MANIFEST, f"files: {str(name)[:80]!r} is no file of a run bundle")
        if not isinstance(entry, dict) or not re.fullmatch(r"[0-9a-f]{64}", str(entry.get("sha256", ""))):
            raise BundleError(MANIFEST, f"files.{name}: no sha256")
        digests[name] = entry["sha256"]
    missing = [n for n in DOCUMENTS if n not in digests]
    if missing:
        raise BundleError(MANIFEST, f"files: lacks {missing}")
    return digests


def check_digest(name: str, data: bytes, digests: Mapping[str, str]) -> None:
    got = sha256(data)
    if got != digests[name]:
        raise BundleError(name, f"sha256 {got} does not match the manifest's {digests[name]}: the file was changed "
                                "after export")


def verify_bundle(directory: Path) -> dict[str, str]:
    """Check every file of the bundle at `directory` against its manifest (and that it holds no other);
    the manifest's digests."""
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
    except (OSError, ValueError) as exc:
        raise BundleError(MANIFEST, f"cannot read it: {exc}") from None
    digests = check_manifest(manifest)
    for name in digests:
        try:
            data = (directory / name).read_bytes()
        except OSError as exc:
            raise BundleError(name, f"listed in the manifest but cannot be read: {exc.strerror or exc}") from None
        check_digest(name, data, digests)
    records = directory / RECORD_DIR
    for path in sorted(records.iterdir()) if records.is_dir() else []:
        if f"{RECORD_DIR}/{path.name}" not in digests:
            raise BundleError(f"{RECORD_DIR}/{path.name}", "not in the manifest")
    return digests


@dataclass(frozen=True)
class Bundle:
    directory: Path
    run: dict
    spec: dict
    fingerprint: dict | None
    metrics: dict
    events: list
    checkpoint: dict | None
    records: dict[int, Path]


def load_bundle(directory: Path) -> Bundle:
    """A verified bundle's documents, checked as `parse_documents` does."""
    digests = verify_bundle(directory)
    docs = parse_documents({name: (directory / name).read_bytes() for name in DOCUMENTS})
    records = {int(m.group(1)): directory / name for name in digests if (m := RECORD_NAME.match(name))}
    return Bundle(directory, docs["run.json"], docs["spec.json"], docs["fingerprint.json"], docs["metrics.json"],
                  docs["events.json"], docs["checkpoint.json"], records)


def _number(x: object) -> bool:
    """A finite JSON number that a float holds (an integer past float's range is no metric)."""
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:
        return False


def parse_documents(files: Mapping[str, bytes]) -> dict[str, object]:
    """Each document of a bundle parsed and checked for the shape an import stores; errors name the file."""
    docs: dict[str, object] = {}
    for name in DOCUMENTS:
        if name not in files:
            raise BundleError(name, "missing")
        try:
            docs[name] = loads_bounded(files[name], field=name, max_bytes=MAX_DOCUMENT_BYTES)
        except ValueError as exc:
            raise BundleError(name, f"not JSON within bounds: {exc}") from None
    run = docs["run.json"]
    if not isinstance(run, dict):
        raise BundleError("run.json", "not an object")
    for key, kind in (("id", str), ("name", str), ("status", str), ("error", str)):
        if not isinstance(run.get(key), kind):
            raise BundleError("run.json", f"{key}: missing or not a {kind.__name__}")
    for key in ("step", "steps"):
        if not isinstance(run.get(key), int) or isinstance(run.get(key), bool) or run[key] < 0:
            raise BundleError("run.json", f"{key}: missing or not a count")
    for key in ("created_at", "updated_at"):
        if not _number(run.get(key)):
            raise BundleError("run.json", f"{key}: missing or not a number")
    if run["status"] not in ENDED:
        raise BundleError("run.json", f"status: {run['status']!r} has not ended; export the run once it is one of "
                                      f"{list(ENDED)}")
    if not isinstance(docs["spec.json"], dict):
        raise BundleError("spec.json", "not an object")
    for name in ("fingerprint.json", "checkpoint.json"):
        if docs[name] is not None and not isinstance(docs[name], dict):
            raise BundleError(name, "neither an object nor null")
    metrics = docs["metrics.json"]
    if not isinstance(metrics, dict) or not isinstance(metrics.get("steps"), list):
        raise BundleError("metrics.json", "steps: missing or not a list")
    if metrics.get("eval_initial") is not None and not isinstance(metrics["eval_initial"], dict):
        raise BundleError("metrics.json", "eval_initial: neither an object nor null")
    previous = 0
    for i, s in enumerate(metrics["steps"]):
        where = f"steps[{i}]"
        if (not isinstance(s, dict) or not isinstance(s.get("step"), int) or isinstance(s["step"], bool)
                or s["step"] <= previous):
            raise BundleError("metrics.json", f"{where}.step: missing, or not after the previous step")
        previous = s["step"]
        for key in ("metrics", "timings"):
            values = s.get(key)
            if not isinstance(values, dict) or not all(isinstance(k, str) and _number(v) for k, v in values.items()):
                raise BundleError("metrics.json", f"{where}.{key}: not a mapping of names to finite numbers")
    if previous > run["steps"]:
        raise BundleError("metrics.json", f"step {previous} is past the run's {run['steps']} steps")
    events = docs["events.json"]
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise BundleError("events.json", "not a list of objects")
    return docs


def documents_from_upload(manifest: object, files: Mapping[str, str]) -> dict[str, object]:
    """What an import stores: the documents sent (text), each checked against the manifest's digest."""
    digests = check_manifest(manifest)
    raw = {}
    for name in DOCUMENTS:
        if name not in files:
            raise BundleError(name, "missing from the upload")
        raw[name] = files[name].encode()
        check_digest(name, raw[name], digests)
    extra = sorted(set(files) - set(DOCUMENTS))
    if extra:
        raise BundleError(extra[0][:80], "not a document of a run bundle (step records stay in the bundle)")
    return parse_documents(raw)


def recorded_step(directory: Path, step: int) -> tuple[Bundle, Path, dict]:
    """A verified bundle, its record of `step` and that step's recorded metrics; refused naming what lacks."""
    bundle = load_bundle(directory)
    record = bundle.records.get(step)
    if record is None:
        raise BundleError("step", f"the bundle holds no record of step {step} (recorded: "
                                  f"{sorted(bundle.records) or 'none: the run did not set debug.record_trajectories'})")
    metrics = next((s["metrics"] for s in bundle.metrics["steps"] if s["step"] == step), None)
    if metrics is None:
        raise BundleError("metrics.json", f"no metrics of step {step}")
    return bundle, record, metrics
