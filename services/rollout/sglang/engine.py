"""The SGLang rollout engine: an SGLang server child process behind the Engine interface.

- load: launch the server on the model directory (or attach to `url`), with
  --weight-version = the policy version.
- generate: one batched /generate with token ids; every sample carries its own
  seed; per-token log-probs come from meta_info.output_token_logprobs and are
  those of the temperature-scaled distribution (sglang/client.py says where).
  Every sample's weight_version is checked against the policy version.
- request_pause (async.mode streaming): /pause_generation in "abort" mode, then
  /continue_generation; the aborted /generate returns each unfinished sample
  with its tokens so far as 'paused', and a later generate continues it with
  prompt + those tokens as input (sglang_client.generate_body). Every /generate
  runs under one weight version (checked per token span), so each token's
  version is the version of the call that made it.
- update_weights: the tensors are verified against the checkpoint, written as a
  Hugging Face directory under `weights_dir`, then loaded with
  /update_weights_from_disk between /pause_generation and /continue_generation.
  That directory is also what a restarted server loads.
- The server dying mid-batch: the call raises EngineUnavailable (the rollout
  service answers UNAVAILABLE and the coordinator re-dispatches), and the
  server is restarted in the background from the current weights at the
  current version. The next call waits for that restart.

- update_lora_adapter (a LoRA run, server launched with `server.max_lora_rank`):
  the adapter is checked against the model, written in peft's layout under
  `weights_dir`, loaded with /load_lora_adapter as `policy-v<version>` and the
  server's weight_version relabelled; every later /generate names it in
  lora_path, and the previous version's adapter is unloaded. A restarted server
  loads the current adapter again.

- receive_broadcast (rollout.weight_sync broadcast): sglang/broadcast.py.

There is no fallback to another engine: if SGLang cannot run, load fails.
The LoRA path needs GPUs (SGLang's LoRA layers do not build on CPU:
services/common/platform.py says why, and refuses it at load); it is
unit-tested by request only.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
import uuid
import weakref
from pathlib import Path

import torch

from contract.command_line import check_arg_value, render_spec_options
from contract.engine_options import SGLangEngineConfig
from contract.sglang_command import engine_run_options, engine_switches
from services.common.models.directory import check_model_dir, layout_digest
from services.common.platform import Platform, probe_platform, sglang_launch_plan
from services.common.weights.stream import LoraAdapterMeta
from services.rollout.config import RolloutServiceConfig
from services.rollout.engine import Engine, EngineUnavailable
from services.rollout.sglang.broadcast import SGLangBroadcast
from services.rollout.sglang.client import (
    MoeShape,
    SGLangClient,
    check_request,
    SGLangConnectionError,
    SGLangRequestError,
    generate_body,
    parse_generate_response,
)
from services.rollout.sglang.config import SGLangHostConfig
from services.rollout.sglang.server import SGLangServer, SGLangStartError
from services.rollout.sglang.weights import (
    checkpoint_specs,
    eos_token_ids,
    load_checkpoint_tensors,
    tied_embeddings,
    verify_tensors,
    write_checkpoint,
)
from services.rollout.types import GeneratedSample, GenerationRequest
from services.rollout.weights.lora_adapter import ADAPTER_WEIGHTS_FILE, module_adapters, write_peft_adapter

log = logging.getLogger("lockstep.rollout.sglang")

# Engines of this process that launched a server on a fixed port. The rollout
# service loads a run's new engine before it closes the previous one (a failed
# load must leave the old one serving); with a fixed port (compose: 30000, the
# Prometheus target) the new server could never bind, so the previous holder of
# the port gives it up first.
_PORT_HOLDERS: "weakref.WeakValueDictionary[tuple[str, int], SGLangEngine]" = weakref.WeakValueDictionary()


def moe_shape(hf_config: dict) -> MoeShape:
    """The routed-experts table shape of a Hugging Face config whose every decoder layer is an MoE layer
    (SGLang captures one row of experts per layer); ValueError naming engine_config.return_routed_experts
    otherwise."""
    field = "engine_config.return_routed_experts"
    experts, top_k = hf_config.get("num_experts"), hf_config.get("num_experts_per_tok")
    if not isinstance(experts, int) or not isinstance(top_k, int) or experts < 1:
        raise ValueError(f"{field}: the model (model_type {hf_config.get('model_type')!r}) has no "
                         "mixture-of-experts layers")
    if hf_config.get("mlp_only_layers") or hf_config.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{field}: the model has dense layers between its MoE layers (mlp_only_layers, "
                         "decoder_sparse_step); only models whose every layer routes are covered")
    return MoeShape(int(hf_config["num_hidden_layers"]), top_k, experts)


class SGLangEngine(SGLangBroadcast, Engine):
    name = "sglang"
    supports_episodes = True  # each turn is one /generate of the episodes' contexts as input_ids
    supports_resume = True  # paused by aborting the call's requests; continued from their tokens

    def __init__(self, config: SGLangEngineConfig | None = None, host: SGLangHostConfig | None = None):
        self.config = config or SGLangEngineConfig()
        self.host = host or SGLangHostConfig()
        # The server's --api-key: the operator's for an attached server, else one generated per engine and kept
        # in memory only (the rollout service is the server's only client; /health and /metrics stay open).
        if self.host.url:
            if self.host.api_key is None:
                raise ValueError("sglang_api_key_file: required with sglang_url (the attached server's --api-key)")
            self._api_key = self.host.api_key.get_secret_value()
        else:
            self._api_key = secrets.token_urlsafe(32)
        platform = probe_platform(os.environ) if self.config.platform == "auto" else Platform(self.config.platform)
        # Decided once, here, so that a bad combination (e.g. deterministic on
        # CPU) fails at construction, before anything is launched.
        self.plan = sglang_launch_plan(platform, self.config.server, os.environ)
        # The run's own values on the server's command line besides the platform's (the builder checks them
        # all again at every launch). Checked here too, so that a bad one fails LoadModel before anything runs.
        self._run_options = engine_run_options(self.config)
        render_spec_options((*self.plan.options, *self._run_options))
        self._state = threading.Lock()  # guards the fields below against the restart thread
        self._server: SGLangServer | None = None
        self._client: SGLangClient | None = None
        self._restart: threading.Thread | None = None
        self._unavailable: str | None = None  # set when restarts gave up
        self._restarts = 0
        self._version = -1
        self._model_path = ""
        self._weights_path = ""  # the directory the server's current weights came from
        self._lora: tuple[str, str] | None = None  # (name, directory) of the adapter served with the base
        self._specs: dict = {}
        self._layout = ""  # layout_digest of the loaded model directory
        self._tied = False
        self._eos: set[int] = set()
        self._vocab = 0
        self._routing: MoeShape | None = None  # return_routed_experts: what each sample's table holds
        self._max_len: int | None = None
        self._generating = threading.Event()  # a generate() call is in flight (read by request_pause)
        self._pause_asked = threading.Event()  # request_pause aborted that call's requests
        self._dir = Path(self.host.weights_dir) / f"engine-{uuid.uuid4().hex[:12]}"
        # A restarted server loads a synced version from under this directory with --model-path=<it>.
        check_arg_value(str(self._dir), "sglang_weights_dir")

    @classmethod
    def from_config_json(cls, text: str, service: RolloutServiceConfig | None = None) -> "SGLangEngine":
        """Registry entry point: build from LoadModelRequest.engine_config_json (ValueError names the field),
        with what the rollout service's own configuration decides (interpreter, directories, server URL)."""
        host = SGLangHostConfig.from_service(service) if service is not None else SGLangHostConfig()
        return cls(SGLangEngineConfig.from_json(text), host)

    def _client_for(self, url: str) -> SGLangClient:
        return SGLangClient(url, timeout_s=self.config.request_timeout_s, api_key=self._api_key)

    # ------------------------------------------------------------ lifecycle --

    def load(self, model_path: str, policy_version: int) -> None:
        path = check_model_dir(model_path)
        self._specs = checkpoint_specs(path)
        self._layout = layout_digest(path)
        self._tied = tied_embeddings(path)
        self._eos = eos_token_ids(path)
        hf = json.loads((path / "config.json").read_text())
        self._vocab = int(hf.get("vocab_size", 0))
        self._routing = moe_shape(hf) if self.config.return_routed_experts else None
        self._max_len = hf.get("max_position_embeddings")
        version = str(policy_version)
        if self.host.url:
            client = self._client_for(self.host.url)
            if not client.healthy():
                raise EngineUnavailable(f"sglang: no healthy server at sglang_url {self.host.url}")
            # The attached server may hold anything: load exactly what we were told.
            client.update_weights_from_disk(str(path), version, self.config.weight_update_timeout_s)
            self._client = client
        else:
            # The server gets it as --model-path=<path>: refused here, before a previous engine gives up its port.
            check_arg_value(str(path), "model_path")
            bind = (self.host.server_host, self.host.server_port)
            if bind[1]:
                holder = _PORT_HOLDERS.get(bind)
                if holder is not None and holder is not self:
                    log.warning("sglang: port %d is held by a previous engine; closing it", bind[1])
                    holder.close()
                    holder._unavailable = f"sglang: replaced by a newer engine on port {bind[1]}"
            server = self._new_server()
            try:
                server.start(str(path), version, self.config.startup_timeout_s)
            except SGLangStartError as exc:
                raise RuntimeError(f"sglang engine: {exc}") from None
            self._server = server
            self._client = self._client_for(server.url)
            if bind[1]:
                _PORT_HOLDERS[bind] = self
        self._model_path = self._weights_path = str(path)
        self._version = policy_version
        self._check_version(self._client)
        log.info("sglang engine loaded %s at version %d (%s)", path, policy_version, self.url)

    def reload(self, config_json: str, model_path: str, policy_version: int) -> bool:
        """A new run on the server this engine launched, instead of a new server: when the run's options equal
        this engine's and the model directory differs from the served one only in its weights (same files
        otherwise, same tensors), the server's command line would be the same, so its start (tens of seconds
        on a CPU, minutes for a large model on a GPU) is saved. The weights come from disk as a synced
        version's do (SGLang flushes its prefix cache with them) and any adapter is dropped."""
        if self.host.url or self._server is None or self._restart is not None or self._unavailable:
            return False
        try:
            config = SGLangEngineConfig.from_json(config_json)
        except ValueError:
            return False  # building the new engine reports it, naming the field
        path = check_model_dir(model_path)
        if (config != self.config or layout_digest(path) != self._layout
                or checkpoint_specs(path) != self._specs):
            return False
        check_arg_value(str(path), "model_path")  # a restart may launch with it
        self.update_weights_from_path(str(path), policy_version)
        self._model_path = str(path)
        log.info("sglang engine reloaded %s at version %d on its running server (%s)", path, policy_version, self.url)
        return True

    def _new_server(self) -> SGLangServer:
        host = self.host
        return SGLangServer(
            host.python, self.plan, host=host.server_host, port=host.server_port, run_options=self._run_options,
            extra_args=host.extra_args, log_dir=self._dir / "logs", api_key=self._api_key,
            switches=engine_switches(self.config),
        )

    def close(self) -> None:
        t = self._restart
        if t is not None:
            t.join(timeout=self.config.startup_timeout_s)
        with self._state:
            server, client = self._server, self._client
            self._server = self._client = None
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        shutil.rmtree(self._dir / "weights", ignore_errors=True)

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def model_path(self) -> str:
        return self._model_path

    @property
    def url(self) -> str:
        if self._client is not None:
            return self._client.base_url
        return self.host.url

    @property
    def server_pid(self) -> int | None:
        return self._server.pid if self._server is not None else None

    @property
    def weights_path(self) -> str:
        return self._weights_path

    @property
    def restarts(self) -> int:
        return self._restarts

    def info(self) -> dict[str, str]:
        return {
            "engine": self.name,
            "platform": self.plan.platform.value,
            "server_flags": " ".join((*self.plan.flags,
                                      *render_spec_options((*self.plan.options, *self._run_options)))),
            "url": self.url,
            "server_pid": str(self.server_pid or ""),
            "attached": str(bool(self.host.url)).lower(),
            "weights_path": self._weights_path,
            "restarts": str(self._restarts),
            "state": "unavailable" if self._unavailable else ("restarting" if self._restart else "serving"),
        }

    # ------------------------------------------------------------- generate --

    def max_sequence_tokens(self) -> int | None:
        return self._max_len

    def validate_request(self, request: GenerationRequest) -> None:
        """Checks against the loaded model; ValueError names the field."""
        check_request(request, vocab=self._vocab, max_len=self._max_len, eos=self._eos)

    def generate(self, request: GenerationRequest) -> list[GeneratedSample]:
        if self._unavailable:
            raise EngineUnavailable(self._unavailable)
        if not self._specs:
            raise RuntimeError("sglang engine: no model loaded (call load first)")
        self.validate_request(request)
        client = self._ready_client()
        n = len(request.prompts) * request.samples_per_prompt
        body = generate_body(request, self._lora[0] if self._lora else None,
                             routed_experts=self._routing is not None)
        self._pause_asked.clear()
        self._generating.set()
        try:
            out = client.generate(body)
        except SGLangConnectionError as exc:
            self._lost(exc, f"{n} samples lost")
        except SGLangRequestError as exc:
            if self._server is not None and not self._server.alive():
                self._lost(exc, f"{n} samples lost")
            if exc.status == 400:
                raise ValueError(f"sglang rejected the request: {exc}") from None
            raise
        finally:
            self._generating.clear()
        return parse_generate_response(request, out, str(self._version), pause_asked=self._pause_asked.is_set(),
                                       routing=self._routing)

    def request_pause(self) -> bool:
        """Abort the requests of the generate() in flight (it returns them as 'paused' with their tokens so
        far) and let the server take requests again at once. Blocks for the server's pause, which waits
        until every aborted request returned. Its own connection: the call in flight holds the engine's."""
        if not self._generating.is_set():
            return False
        self._pause_asked.set()
        client = self._client_for(self.url)
        try:
            try:
                client.pause_generation("abort")
            finally:  # a server left paused would hold every later call
                client.continue_generation()
        except SGLangConnectionError:
            return False  # the server is gone: the call in flight fails and the engine restarts it
        finally:
            client.close()
        return True

    # ------------------------------------------------------- update weights --

    def update_weights(self, tensors: dict[str, torch.Tensor], policy_version: int, *,
                       finite_checked: bool = False) -> None:
        """Verify, write the checkpoint, then load it into the server; on any error nothing changes.
        The finite check runs whatever `finite_checked` says: beside writing a checkpoint it costs little.

        Re-sending the current version with identical weights is a no-op;
        different weights under the current version, or an older version, are refused.
        """
        sent = self._checked_update(tensors, policy_version)
        if sent is None:
            return
        target = self._dir / "weights" / f"v{policy_version:09d}"
        shutil.rmtree(target, ignore_errors=True)  # left by an attempt that did not complete
        path = write_checkpoint(sent, self._model_path, target)
        self.update_weights_from_path(str(path), policy_version)

    def update_weights_from_dir(self, directory: str, tensors: dict[str, torch.Tensor], policy_version: int) -> None:
        """The directory is a complete model directory (the trainer's WriteWeights): checked as update_weights
        checks, then SGLang loads it in place, with no second copy written."""
        if self._checked_update(tensors, policy_version) is not None:
            self.update_weights_from_path(directory, policy_version)

    def _checked_update(self, tensors: dict[str, torch.Tensor], policy_version: int) -> dict[str, torch.Tensor] | None:
        """The tensors to apply, verified against the model; None when they are the loaded version's own."""
        if not self._specs:
            raise RuntimeError("sglang engine: no model loaded (call load first)")
        if policy_version < self._version:
            raise ValueError(f"policy_version: {policy_version} is older than the loaded {self._version}")
        sent = verify_tensors(tensors, self._specs, tied=self._tied)
        if policy_version == self._version:
            current = load_checkpoint_tensors(self._weights_path)
            if all(torch.equal(current[k], v.to("cpu", current[k].dtype)) for k, v in sent.items()):
                return None
            raise ValueError(f"policy_version: {policy_version} is loaded already with different weights")
        return sent

    def update_weights_from_path(self, path: str, policy_version: int) -> None:
        """Load a complete checkpoint directory (written by us or by the trainer) as `policy_version`."""
        check_model_dir(path)
        client = self._ready_client()
        version = str(policy_version)
        try:
            # Calls are serialized, so nothing of ours is in flight; "abort"
            # drops anything an earlier, abandoned call left running.
            client.pause_generation("abort")
            try:
                client.update_weights_from_disk(path, version, self.config.weight_update_timeout_s)
            finally:
                client.continue_generation()
        except SGLangConnectionError as exc:
            # The server restarts from the weights it held; the caller retries the update.
            self._lost(exc, f"weight update to version {policy_version} not applied")
        old = self._weights_path
        self._weights_path, self._version = path, policy_version
        self._check_version(client)
        self._prune(keep={path, old})
        if self._lora is not None:  # a whole new set of weights: no adapter on top of it
            name, adapter_dir = self._lora
            self._lora = None
            client.unload_lora_adapter(name)
            shutil.rmtree(adapter_dir, ignore_errors=True)

    def update_lora_adapter(self, meta: LoraAdapterMeta, tensors: dict[str, torch.Tensor], policy_version: int) -> None:
        """Serve the base with this adapter from `policy_version` on; checked first, nothing changes on an error.

        Re-sending the current version's adapter is a no-op; another adapter under it, or an older version,
        is refused."""
        server = self.config.server
        if server.max_lora_rank is None:
            raise ValueError("weights.lora: this sglang engine was launched without LoRA serving; set "
                             "engine_config.server.max_lora_rank (at least the adapter's rank)")
        if meta.rank > server.max_lora_rank:
            raise ValueError(f"weights.lora.rank: {meta.rank} exceeds engine_config.server.max_lora_rank "
                             f"{server.max_lora_rank}")
        outside = sorted(set(meta.target_modules) - set(server.lora_target_modules))
        if "all" not in server.lora_target_modules and outside:
            raise ValueError(f"weights.lora.target_modules: {outside} are not in engine_config.server."
                             f"lora_target_modules {list(server.lora_target_modules)}")
        if not self._specs:
            raise RuntimeError("sglang engine: no model loaded (call load first)")
        if policy_version < self._version:
            raise ValueError(f"policy_version: {policy_version} is older than the loaded {self._version}")
        problems = []
        for module, adapter in module_adapters(tensors, meta).items():
            spec = self._specs.get(f"{module}.weight")
            if spec is None:
                problems.append(f"{module}: no weight of that name in the model")
            elif (adapter.b.shape[0], adapter.a.shape[1]) != tuple(spec[0]):
                problems.append(f"{module}: adapter B @ A is {adapter.b.shape[0]} x {adapter.a.shape[1]}, "
                                f"the weight {tuple(spec[0])}")
        if problems:
            raise ValueError("weights: " + "; ".join(problems[:8]))
        if policy_version == self._version:
            current = self._current_adapter()
            if current is not None and set(current) == set(tensors) and all(
                    torch.equal(current[k], v.cpu()) for k, v in tensors.items()):
                return
            raise ValueError(f"policy_version: {policy_version} is loaded already with different weights")
        target = self._dir / "adapters" / f"v{policy_version:09d}"
        shutil.rmtree(target, ignore_errors=True)  # left by an attempt that did not complete
        write_peft_adapter(target, {k: v.cpu() for k, v in tensors.items()}, meta, base_model_path=self._model_path)
        name = f"policy-v{policy_version}"
        client = self._ready_client()
        try:
            client.pause_generation("abort")
            try:
                client.load_lora_adapter(name, str(target))
                client.update_weight_version(str(policy_version))
            finally:
                client.continue_generation()
        except SGLangConnectionError as exc:
            self._lost(exc, f"LoRA adapter of version {policy_version} not applied")
        old, self._lora, self._version = self._lora, (name, str(target)), policy_version
        self._check_version(client)
        if old is not None:
            client.unload_lora_adapter(old[0])
            shutil.rmtree(old[1], ignore_errors=True)

    def _current_adapter(self) -> dict[str, torch.Tensor] | None:
        if self._lora is None:
            return None
        from safetensors.torch import load_file

        return load_file(str(Path(self._lora[1]) / ADAPTER_WEIGHTS_FILE))

    def _prune(self, keep: set[str]) -> None:
        root = self._dir / "weights"
        if not root.is_dir():
            return
        dirs = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))
        for p in dirs[: max(0, len(dirs) - self.config.keep_versions)]:
            if str(p) not in keep:
                shutil.rmtree(p, ignore_errors=True)

    # ----------------------------------------------------------------- LoRA --

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> None:
        self._ready_client().load_lora_adapter(lora_name, lora_path, pinned)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self._ready_client().unload_lora_adapter(lora_name)

    # ------------------------------------------------------ loss and restart --

    def _check_version(self, client: SGLangClient) -> None:
        held = client.weight_version()
        if held != str(self._version):
            raise RuntimeError(
                f"sglang server reports weight_version {held!r}, the engine expects {self._version}"
            )

    def _ready_client(self) -> SGLangClient:
        """The client of a serving server; waits for a restart in progress; EngineUnavailable otherwise."""
        t = self._restart
        if t is not None:
            t.join(timeout=self.config.startup_timeout_s + 30)
            if t.is_alive():
                raise EngineUnavailable("sglang server is still restarting")
        if self._unavailable:
            raise EngineUnavailable(self._unavailable)
        server, client = self._server, self._client
        if client is None:
            raise RuntimeError("sglang engine: no model loaded (call load first)")
        if server is not None and not server.alive():
            # Died while idle: nothing was lost, so restart and serve this call.
            self._lost(None, "no work lost (server died between calls)", raise_=False)
            return self._ready_client()
        return client

    def _lost(self, exc: BaseException | None, what: str, raise_: bool = True) -> None:
        server = self._server
        if self.host.url or server is None:
            raise EngineUnavailable(f"sglang server at {self.url} lost ({exc}); {what}; attached, not restarting")
        code = server.exit_code()
        reason = (
            f"sglang server pid {server.pid} lost (exit code {code}, {type(exc).__name__ if exc else 'died'}); {what}; "
            f"restarting from {self._weights_path or '<no reloadable weights>'} at policy version {self._version}"
        )
        log.warning(reason)
        with self._state:
            if self._restart is None:
                self._restart = threading.Thread(target=self._restart_server, name="sglang-restart", daemon=True)
                self._restart.start()
        if raise_:
            raise EngineUnavailable(reason) from exc
        t = self._restart
        if t is not None:
            t.join(timeout=self.config.startup_timeout_s + 30)

    def _restart_server(self) -> None:
        try:
            old = self._server
            if old is not None:
                old.stop(grace_s=5.0)
            if self._client is not None:
                self._client.close()
            if not self._weights_path:
                self._unavailable = (
                    "sglang server lost after an NCCL weight update: those weights are not on disk to reload"
                )
                return
            errors = []
            for attempt in range(self.config.max_restarts):
                server = self._new_server()
                try:
                    server.start(self._weights_path, str(self._version), self.config.startup_timeout_s)
                except (SGLangStartError, OSError) as err:
                    errors.append(f"attempt {attempt + 1}: {err}")
                    continue
                if self._lora is not None:  # the base came back from disk; its adapter is loaded again
                    reload = self._client_for(server.url)
                    try:
                        reload.load_lora_adapter(*self._lora)
                    except (SGLangConnectionError, SGLangRequestError) as err:
                        server.stop()
                        errors.append(f"attempt {attempt + 1}: reloading LoRA adapter {self._lora[0]}: {err}")
                        continue
                    finally:
                        reload.close()
                with self._state:
                    self._server = server
                    self._client = self._client_for(server.url)
                    self._restarts += 1
                log.warning("sglang server restarted (pid %s) at version %d", server.pid, self._version)
                return
            self._unavailable = f"sglang server could not be restarted ({self.config.max_restarts} attempts): " + (
                " | ".join(e[:500] for e in errors) or "max_restarts is 0"
            )
        finally:
            with self._state:
                self._restart = None
