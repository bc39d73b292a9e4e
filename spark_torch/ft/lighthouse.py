"""The run's torchft lighthouse, hosted by the driver (:class:`Lighthouse`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from spark_torch.ft.gate import AddressGate
from spark_torch.ft.hideout import Hideout, NoHideout
from spark_torch.ft.install import install_hint
from spark_torch.ft.pump import Pump
from spark_torch.ft.wiring import bind_address

__all__ = ["Lighthouse", "LighthouseOptions", "HEARTBEAT_TIMEOUT_MS", "QUORUM_TICK_MS"]

logger = logging.getLogger(__name__)

#: where torchft's server listens when it cannot be hidden
LOOPBACK = "127.0.0.1"


#: a group silent this long is no longer counted as alive (torchft's default: 5000). A live group
#: is vouched for by the lighthouse's pump (:mod:`spark_torch.ft.pump`, every 50 ms, next to the
#: lighthouse) until the driver learns that a rank of it ended, so a dead group is out of the next
#: quorum this long after its death is known, and a slow healthy one is not dropped when its own
#: heartbeats, relayed through busy processes, come late; the pump would have to stall 150 ms to
#: drop one (docs/fault-tolerance.md)
HEARTBEAT_TIMEOUT_MS = 200
#: how often the lighthouse looks for a quorum while one is awaited (torchft's default: 100)
QUORUM_TICK_MS = 20


@dataclass(frozen=True)
class LighthouseOptions:
    """torchft's quorum rules: at least ``min_replicas`` groups form a quorum; a group that stops
    heartbeating for ``heartbeat_timeout_ms`` is dropped from it (spark_torch's default
    :data:`HEARTBEAT_TIMEOUT_MS`: a surviving group waits that long after the driver learns
    that a rank of a dead one ended, not torchft's 5 s; each rank 0's torchft Manager heartbeats
    every 100 ms); the lighthouse
    looks for a quorum every ``quorum_tick_ms`` (default :data:`QUORUM_TICK_MS`);
    ``join_timeout_ms`` as torchft's lighthouse has it. None: torchft's own default. The live
    groups are heartbeated by the lighthouse's pump as well (:mod:`spark_torch.ft.pump`), until
    :meth:`Lighthouse.retire` says their ranks ended."""

    min_replicas: int = 1
    join_timeout_ms: int | None = None
    quorum_tick_ms: int | None = QUORUM_TICK_MS
    heartbeat_timeout_ms: int | None = HEARTBEAT_TIMEOUT_MS


class Lighthouse:
    """The run's torchft lighthouse, hidden where no other user can reach it (a child process in
    its own network namespace, :class:`~spark_torch.ft.hideout.Hideout`), reached by the ranks at
    ``advertise`` (default ``host``) through an :class:`~spark_torch.ft.gate.AddressGate` on ``host``
    that lets in this user's connections from this machine and, from other machines, the
    addresses ``allowed`` returns (the cluster's; None: any). With ``secret`` (distributed mode),
    that gate on ``host`` admits only connections that prove it (the nodes' relays:
    :mod:`spark_torch.ft.node_relay`), and the gate for this user's connections of this machine
    (:attr:`host`, :attr:`port`: the driver's own look at the lighthouse) is on loopback. Its pump
    (:class:`~spark_torch.ft.pump.Pump`, in the lighthouse's process) heartbeats every live group
    until :meth:`retire` says its ranks ended. Where the kernel refuses the
    namespace, torchft's server runs in this process on loopback, behind the same gate, and a
    WARNING says that another user of this machine can reach it. Stopped by :meth:`close`
    (idempotent) or on leaving a ``with`` block, whatever the end: nothing listens after it."""

    def __init__(
        self,
        host: str,
        options: LighthouseOptions | None = None,
        advertise: str | None = None,
        allowed: Callable[[], set[str]] | None = None,
        secret: bytes | None = None,
    ) -> None:
        try:
            from torchft.coordination import LighthouseServer
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(f"replica_groups > 1 needs torchft ({exc}): {install_hint()}") from exc
        opts = options or LighthouseOptions()
        self.host = host if secret is None else LOOPBACK
        self.advertise = advertise or host
        self._lock = threading.Lock()  # a failing group's thread and the driver may both close it
        self._server: Any | None = None
        #: the pump of a lighthouse not hidden (in this process; the hidden one has its own)
        self._pump: Pump | None = None
        self._gate: AddressGate | None = None
        #: the gate the nodes' relays reach, with ``secret`` (else None)
        self._relay_gate: AddressGate | None = None
        #: the hidden lighthouse's process (None: it runs in this process, on loopback)
        self.hideout: Hideout | None = None
        #: where torchft's server listens on loopback when it could not be hidden (else None)
        self.server_port: int | None = None
        try:
            try:
                self.hideout = Hideout.start(
                    (opts.min_replicas, opts.join_timeout_ms, opts.quorum_tick_ms, opts.heartbeat_timeout_ms)
                )
                backend: str | tuple[str, int] = self.hideout.path
            except NoHideout as exc:
                logger.warning(
                    "spark_torch: torchft's lighthouse could not be hidden from other users of this machine (%s): it "
                    "listens on %s, where any local user can reach it (docs/security.md)",
                    exc,
                    LOOPBACK,
                )
                self._server = LighthouseServer(
                    bind=bind_address(LOOPBACK, 0),
                    min_replicas=opts.min_replicas,
                    join_timeout_ms=opts.join_timeout_ms,
                    quorum_tick_ms=opts.quorum_tick_ms,
                    heartbeat_timeout_ms=opts.heartbeat_timeout_ms,
                )
                # torchft advertises the machine's hostname; the ranks get the gate's address
                self.server_port = int(self._server.address().rsplit(":", 1)[1])
                backend = (LOOPBACK, self.server_port)
                import torchft._torchft as core

                self._pump = Pump(self.server_port, core)
            self._gate = AddressGate(self.host, backend, allowed if secret is None else (lambda: set()))
            if secret is not None:
                self._relay_gate = AddressGate(host, backend, allowed, secret=secret)
        except BaseException:
            self.close()
            raise
        #: the port of the gate for this user's connections of this machine (the ranks' in local mode)
        self.port = self._gate.port
        #: the port the ranks reach (through their node's relay with ``secret``)
        self.ranks_port = self._relay_gate.port if self._relay_gate is not None else self.port

    @property
    def gate(self) -> AddressGate | None:
        """The gate the ranks reach the lighthouse through (None once closed)."""
        return self._gate

    @property
    def address(self) -> str:
        """What the ranks get as ``TORCHFT_LIGHTHOUSE`` (with ``secret``: what their nodes' relays reach)."""
        return f"http://{bind_address(self.advertise, self.ranks_port)}"

    def retire(self, group: int) -> None:
        """A rank of replica group ``group`` ended (or the group's attempt did): the pump stops
        vouching for the group's Managers now, so the lighthouse drops it from the next quorum
        within its heartbeat timeout; a Manager the group makes later (its restart) is vouched
        for again. Nothing once closed."""
        with self._lock:
            hideout, pump = self.hideout, self._pump
        if hideout is not None:
            hideout.retire(group)
        elif pump is not None:
            pump.retire(group)

    def close(self) -> None:
        """Stop listening (idempotent)."""
        with self._lock:
            server, self._server = self._server, None
            gates, self._gate, self._relay_gate = (self._gate, self._relay_gate), None, None
            hideout, self.hideout = self.hideout, None
            pump, self._pump = self._pump, None
        if pump is not None:
            pump.close()
        for gate in gates:
            if gate is not None:
                gate.close()
        if server is not None:
            server.shutdown()
        if hideout is not None:
            hideout.close()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
