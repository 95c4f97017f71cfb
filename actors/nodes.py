"""Groups that span machines (multi-node tensor parallelism): how the supervisors of the nodes agree on
each start of a group.

Node 0's supervisor serves a TCP store at --dist-init-addr for as long as it runs; each start of a group
meets under its own key prefix there (runtime.distributed.meeting_store). Node 0 decides the starts: it
counts them under "GROUP/start", and every other node starts its ranks at the count it reads there. A
node whose rank dies writes the count it died in under "GROUP/failed"; node 0 then takes its own ranks
down, and the whole group starts again, everywhere, at the next count. When node 0's supervisor ends its
store goes with it, and so does every other node's supervisor (NodeStoreError): whatever restarts node 0 (a
LeaderWorkerSet recreates its group) restarts them.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from runtime.cli_args import split_address


class NodeStoreError(RuntimeError):
    """Node 0's store cannot be served (on node 0) or reached (on the others): its supervisor ended, or never began."""


class GroupStore:
    def __init__(self, address: str, node_rank: int, groups: Iterable[str], timeout_s: float) -> None:
        # torch in the supervisor only where a group spans machines; torch exports its stores without __all__
        from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

        host, port = split_address(address)
        self.address, self.leads = address, node_rank == 0
        try:
            self._store = TCPStore(host, port, is_master=self.leads, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise NodeStoreError(f"{'cannot serve' if self.leads else 'found no'} node 0's store at {address}: {exc}") from exc
        if self.leads:
            for group in groups:
                self.announce(group, 1)
                self._set(f"{group}/failed", 0)

    def rendezvous(self, group: str, start: int) -> str:
        """Where the ranks of this start of the group meet (runtime.distributed.meeting_store)."""
        return f"tcp://{self.address}/{group}-{start}"

    def announce(self, group: str, start: int) -> None:
        """Node 0: the group starts, everywhere, for the start-th time."""
        self._set(f"{group}/start", start)

    def start(self, group: str) -> int:
        """The group's current start (on another node, waiting for node 0 to have made the first)."""
        return self._get(f"{group}/start")

    def report_failure(self, group: str, start: int) -> None:
        """A node other than 0: one of its ranks of that start died."""
        self._set(f"{group}/failed", start)

    def failed(self, group: str) -> int:
        """The last start a node reported dead."""
        return self._get(f"{group}/failed")

    def _set(self, key: str, value: int) -> None:
        try:
            self._store.set(key, str(value))
        except RuntimeError as exc:
            raise NodeStoreError(f"node 0's store at {self.address} is gone: {exc}") from exc

    def _get(self, key: str) -> int:
        try:
            return int(self._store.get(key))
        except RuntimeError as exc:
            raise NodeStoreError(f"node 0's store at {self.address} is gone: {exc}") from exc
