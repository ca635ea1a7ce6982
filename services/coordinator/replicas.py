"""Which rollout replicas a run is using right now.

A replica that stops answering (UNAVAILABLE or a deadline: the process died,
the host went away) is evicted: the run goes on with the others instead of
failing at the next weight sync. Before every step the driver probes the
evicted ones; one that answers again is re-admitted only once it holds the
run's current weights (fleet.RolloutFleet.readmit), and when none is
left the run waits for one to do so. Any other error
from a replica -- a refused request, a wrong version after a sync -- is not an
outage and still fails the run: nothing is papered over.

Pure bookkeeping; the driver does the I/O.
"""
from __future__ import annotations

from collections.abc import Sequence

from services.coordinator.clients import RolloutClient


class NoLiveReplica(Exception):
    """Every rollout replica is evicted: the run cannot go on."""


class ReplicaPool:
    def __init__(self, clients: Sequence[RolloutClient]) -> None:
        if not clients:
            raise ValueError("rollout_addresses: at least one rollout replica is needed")
        self._clients = list(clients)
        self._evicted: set[str] = set()

    def all(self) -> list[RolloutClient]:
        return list(self._clients)

    def live(self) -> list[RolloutClient]:
        """Replicas in service, in configuration order (sharding is a function of this list)."""
        return [c for c in self._clients if c.address not in self._evicted]

    def evicted(self) -> list[RolloutClient]:
        return [c for c in self._clients if c.address in self._evicted]

    def is_live(self, client: RolloutClient) -> bool:
        return client.address not in self._evicted

    def evict(self, client: RolloutClient) -> bool:
        """Take a replica out of service; True if it was in service until now."""
        if client.address in self._evicted:
            return False
        self._evicted.add(client.address)
        return True

    def readmit(self, client: RolloutClient) -> None:
        self._evicted.discard(client.address)

    def require_live(self, what: str) -> list[RolloutClient]:
        live = self.live()
        if not live:
            raise NoLiveReplica(
                f"{what}: every rollout replica is unavailable ({', '.join(c.address for c in self._clients)})")
        return live
