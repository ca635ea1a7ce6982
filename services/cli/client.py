"""HTTP client of the coordinator's REST API, shared by the CLI and the demo."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import yaml

from services.common.auth import BearerToken

TERMINAL = ("completed", "failed", "cancelled")
# A paused run goes on only once an operator resumes it (its checkpoint disk was full): waiting for it to
# end would wait forever, so `wait` returns it too, its reason in `error`.
NEEDS_OPERATOR = ("paused",)


class RecipeLoader(yaml.SafeLoader):
    """YAML as a run spec needs it: `lr: 1e-5` is a number (YAML 1.1 reads an exponent without a dot
    as a string, which the API's strict validation then refuses)."""


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class ApiError(RuntimeError):
    def __init__(self, status: int, body: object) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


class CoordinatorClient:
    """Every request carries the deployment's bearer token (the API answers 401 without it)."""

    def __init__(self, base_url: str, *, token: BearerToken, timeout_s: float = 30.0) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                  headers={"Authorization": token.header})

    def _json(self, r: httpx.Response) -> dict:
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
        if r.status_code >= 400:
            raise ApiError(r.status_code, body)
        return body

    def submit(self, spec: dict) -> dict:
        return self._json(self._http.post("/v1/runs", json=spec))

    def runs(self) -> list[dict]:
        return self._json(self._http.get("/v1/runs"))["runs"]

    def run(self, run_id: str) -> dict:
        return self._json(self._http.get(f"/v1/runs/{run_id}"))

    def metrics(self, run_id: str) -> dict:
        return self._json(self._http.get(f"/v1/runs/{run_id}/metrics"))

    def episodes(self, run_id: str, step: int) -> dict:
        return self._json(self._http.get(f"/v1/runs/{run_id}/steps/{step}/episodes"))

    def samples(self, run_id: str, step: int, *, order: str = "record", group: str | None = None,
                offset: int = 0, limit: int = 100) -> dict:
        params = {"order": order, "offset": offset, "limit": limit, **({"group": group} if group else {})}
        return self._json(self._http.get(f"/v1/runs/{run_id}/steps/{step}/samples", params=params))

    def bundle(self, run_id: str) -> dict:
        """Every document of the run's portable bundle, and the steps whose inputs were recorded."""
        return self._json(self._http.get(f"/v1/runs/{run_id}/bundle"))

    def step_record(self, run_id: str, step: int) -> bytes:
        r = self._http.get(f"/v1/runs/{run_id}/step_records/{step}")
        if r.status_code >= 400:
            self._json(r)
        return r.content

    def import_bundle(self, manifest: dict, files: dict[str, str]) -> dict:
        return self._json(self._http.post("/v1/runs/import", json={"manifest": manifest, "files": files}))

    def compare(self, run_ids: list[str], window: int | None = None) -> dict:
        params = {"runs": ",".join(run_ids), **({"window": window} if window is not None else {})}
        return self._json(self._http.get("/v1/compare", params=params))

    def cancel(self, run_id: str) -> dict:
        return self._json(self._http.post(f"/v1/runs/{run_id}/cancel"))

    def resume(self, run_id: str) -> dict:
        """A paused run (its checkpoint disk was full) driven on from its last recorded step."""
        return self._json(self._http.post(f"/v1/runs/{run_id}/resume"))

    def wait(self, run_id: str, *, poll_s: float = 0.25, timeout_s: float | None = None, on_update=None) -> dict:
        """The run once it ends or is paused for the operator (or TimeoutError after `timeout_s`), reading it
        every `poll_s`: polled every quarter second, a run is seen ended 0.125 s after it ends on average
        (0.5 s at one second), for one small read of Redis per poll."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            run = self.run(run_id)
            if on_update:
                on_update(run)
            if run["status"] in TERMINAL + NEEDS_OPERATOR:
                return run
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} still {run['status']} at step {run['step']} after {timeout_s}s")
            time.sleep(poll_s)

    def close(self) -> None:
        self._http.close()


def parse_set_pairs(pairs: list[str]) -> dict:
    """`--set KEY=VALUE` pairs as {KEY: value}: the value as JSON, or the raw text when it is not JSON."""
    out = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def apply_overrides(spec: dict, overrides: dict) -> dict:
    """Set each `key` (dotted for nested fields: 'task.options.path') to its value, in place.

    Intermediate mappings are created when absent; one that holds something
    other than a mapping is an error naming the key, never silently replaced.
    """
    for key, value in overrides.items():
        parts = key.split(".")
        if not all(parts):
            raise ValueError(f"--set {key}: empty field name")
        node = spec
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"--set {key}: {'.'.join(parts[:i + 1])} is {child!r}, not a mapping")
            node = child
        node[parts[-1]] = value
    return spec


def load_recipe(path: str | Path, overrides: dict | None = None) -> dict:
    """A recipe file is a run spec in YAML; relative model paths resolve against the recipe's folder."""
    path = Path(path)
    spec = yaml.load(path.read_text(), Loader=RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a recipe must be a YAML mapping (a run spec)")
    apply_overrides(spec, overrides or {})
    # The model, a distillation run's teacher, an SFT run's dataset and the reward's scorer models, as the model
    # path resolves.
    reward = spec.get("reward") if isinstance(spec.get("reward"), dict) else {}
    for section, key in ((spec, "model_path"), (spec.get("teacher"), "model_path"), (spec.get("sft"), "path"),
                         (reward.get("reward_model"), "model_path"), (reward.get("judge"), "model_path")):
        value = section.get(key) if isinstance(section, dict) else None
        if isinstance(value, str) and not Path(value).is_absolute() and (path.parent / value).exists():
            section[key] = str((path.parent / value).resolve())
    return spec
