"""The broadcast weight path of the SGLang rollout engine, mixed into SGLangEngine (sglang/engine.py).

- receive_broadcast (rollout.weight_sync broadcast): this process announces
  the server's rank at the group's join barrier (the trainer's rendezvous,
  with the deployment's token) and, once every rank has, the server joins the
  trainer's weight-update group (/init_weights_update_group, its store reached
  through a loopback TcpStoreBridge this process holds) and loads each
  bucket the trainer broadcasts (/update_weights_from_distributed,
  "flattened_bucket"), gloo on CPU and NCCL/RCCL on GPUs; those weights are
  not on disk, so a server lost afterwards cannot be restarted with them.

The broadcast path runs against the CPU server over gloo (tests/rollout/sglang/test_sglang_broadcast.py).
"""
from __future__ import annotations

from proto import lockstep_pb2 as pb
from services.common.rendezvous.store import BlockingStore
from services.common.weights.broadcast_protocol import TensorSpec
from services.rollout.sglang.client import SGLangConnectionError, SGLangRequestError
from services.rollout.sglang.weights import verify_broadcast_plan
from services.rollout.weights.broadcast_receiver import await_group_formed
from services.rollout.weights.tcpstore_bridge import LOOPBACK, TcpStoreBridge, is_loopback_url


class SGLangBroadcast:
    """Mixed into SGLangEngine: every attribute and method these use is the engine's (its loaded version,
    checkpoint specs, host and config, _ready_client, _lost, _check_version)."""

    joins_weight_groups = True  # the server is the group's rank, not this process

    def receive_broadcast(self, request: pb.ReceiveWeightsRequest, buckets: list[list[TensorSpec]],
                          store: BlockingStore) -> str:
        """Have the server join the plan's group as the request's rank and load every bucket the trainer
        broadcasts ("flattened_bucket": one flat buffer each); the new version's label is set with the last
        one. Checked before anything moves: a whole-model plan of the checkpoint's names and shapes. Returns
        SGLang's checksum over the parameters it then serves (/weights_checker), which replicas of one
        version must agree on. A failure once buckets started to load leaves the server's weights part
        old, part new: it is restarted from its last directory (EngineUnavailable), never served so.

        `store` is the plan's rendezvous, reached with the deployment's token. The server's ranks speak
        torch's TCPStore protocol, which carries no credentials, so they reach `store` through a
        TcpStoreBridge on this host's loopback (services/rollout/weights/tcpstore_bridge.py), open for this call
        only: the server must run on this host."""
        plan = request.plan
        if plan.HasField("lora"):
            raise ValueError("plan.lora: SGLang loads adapters from files or tensors, not from a process group")
        if plan.digest_trailer:
            raise ValueError("plan.digest_trailer: an SGLang server receives the buckets only; sync it without")
        if plan.policy_version <= self._version:
            raise ValueError(f"policy_version: {plan.policy_version} is not newer than the loaded {self._version}")
        verify_broadcast_plan([(s.name, s.dtype, s.shape) for b in buckets for s in b], self._specs, tied=self._tied)
        if self.host.url and not is_loopback_url(self.host.url):
            raise ValueError(f"rollout.weight_sync: broadcast reaches the SGLang server's ranks through this host's "
                             f"loopback only; the server at sglang_url {self.host.url} is elsewhere (use the "
                             f"grpc weight source)")
        client = self._ready_client()
        timeout = self.config.weight_update_timeout_s
        version = str(plan.policy_version)
        # This process announces the server's rank: a group the trainer gives up on (another replica will
        # not join) fails here, before generation pauses and before the server sits in a constructor.
        await_group_formed(request, store, timeout)
        with TcpStoreBridge(store, plan.group_name) as bridge:
            try:
                client.pause_generation("abort")
                try:
                    client.init_weights_update_group(
                        timeout=timeout, master_address=LOOPBACK, master_port=bridge.port, rank_offset=request.rank,
                        world_size=plan.world_size, group_name=plan.group_name, backend=plan.backend)
                    try:
                        client.begin_weight_update()
                        for i, bucket in enumerate(buckets):
                            last = i == len(buckets) - 1
                            client.update_weights_from_distributed(
                                timeout=timeout, names=[s.name for s in bucket], dtypes=[s.dtype for s in bucket],
                                shapes=[list(s.shape) for s in bucket], group_name=plan.group_name,
                                weight_version=version if last else None, flush_cache=last,
                                load_format="flattened_bucket")
                        client.end_weight_update()
                    finally:
                        client.destroy_weights_update_group(plan.group_name)
                finally:
                    client.continue_generation()
            except (SGLangConnectionError, SGLangRequestError) as exc:
                self._lost(exc, f"broadcast of version {version} interrupted (weights may be partly replaced)")
        # Not on disk: a restarted server could only reload the last synced directory, so mark the
        # weights as not reloadable.
        self._version, self._weights_path = plan.policy_version, ""
        self._check_version(client)
        return client.weights_checksum()
