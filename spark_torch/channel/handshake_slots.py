"""Which pending handshakes the driver's channel keeps when strangers flood its port (pure logic).

Two kinds of slots. Connections from a trusted address (an executor host the driver knew from
Spark when the run started, loopback on a local master) wait in slots of their own address:
at most ``trusted_per_address`` each, which no other address can take. Every other connection
(a stranger, or an executor that joined later, e.g. under dynamic allocation) shares
``total`` slots, at most ``per_address`` of them per address.

When the newcomer's slots are full, a handshake younger than ``min_age`` is never given up: one
of the older ones is closed at random (an attacker cannot aim at the one a node is answering),
and when none is that old the newcomer is refused (its node retries). In the shared slots the
older one must come from an address holding more slots than the newcomer's, so a flood from a
few addresses cannot keep a new address out; from many addresses (one slot each) a newcomer
competes with the flood at random. So a node whose answer takes less than ``min_age`` is never
pushed out by a flood, however fast, and a flood of strangers cannot touch a trusted address's
slots at all.
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["HandshakeSlots", "Admission", "normalize_address"]

K = TypeVar("K", bound=Hashable)


def normalize_address(host: str) -> str:
    """One spelling per address: an IPv4-mapped IPv6 address as IPv4, IPv6 compressed, no zone."""
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


@dataclass(frozen=True)
class Admission(Generic[K]):
    """What to do with a newcomer: keep it (``admitted``) and close ``evict`` first, if set."""

    admitted: bool
    evict: K | None = None


class HandshakeSlots(Generic[K]):
    """Bookkeeping of pending handshakes by address, trusted or not (owned by one thread)."""

    def __init__(
        self,
        trusted: Iterable[str],
        *,
        total: int,
        per_address: int,
        trusted_per_address: int,
        min_age: float,
        rng: random.Random | None = None,
    ) -> None:
        self.trusted = frozenset(normalize_address(h) for h in trusted)
        self._total = total
        self._per_address = per_address
        self._trusted_per_address = trusted_per_address
        self._min_age = min_age
        self._rng = rng or random.Random()
        #: every pending key -> (address, arrival time), in arrival order
        self._keys: dict[K, tuple[str, float]] = {}
        #: per address, its pending keys in arrival order
        self._by_address: dict[str, dict[K, float]] = {}
        self._strangers = 0

    def __len__(self) -> int:
        return len(self._keys)

    def is_trusted(self, host: str) -> bool:
        """Whether ``host`` has slots of its own."""
        return normalize_address(host) in self.trusted

    def admit(self, key: K, host: str, now: float) -> Admission[K]:
        """Decide on a newcomer from ``host`` arriving at ``now`` (monotonic seconds); when
        admitted it is recorded, and ``evict`` (if set) is already forgotten: close it."""
        address = normalize_address(host)
        mine = self._by_address.get(address, {})
        victim: K | None = None
        if address in self.trusted:
            if len(mine) >= self._trusted_per_address:
                victim = self._older(mine.items(), now)
                if victim is None:
                    return Admission(False)
        elif len(mine) >= self._per_address:
            victim = self._older(mine.items(), now)
            if victim is None:
                return Admission(False)
        elif self._strangers >= self._total:
            # only from an address holding more than the newcomer's: a flood from a few addresses
            # cannot keep a new address out, and from many it competes at random
            held = len(mine)
            bigger = (
                (k, t) for k, (a, t) in self._keys.items() if a not in self.trusted and len(self._by_address[a]) > held
            )
            victim = self._older(bigger, now)
            if victim is None:
                return Admission(False)
        if victim is not None:
            self.remove(victim)
        self._keys[key] = (address, now)
        self._by_address.setdefault(address, {})[key] = now
        self._strangers += address not in self.trusted
        return Admission(True, victim)

    def _older(self, candidates: Iterable[tuple[K, float]], now: float) -> K | None:
        """A random one of ``candidates`` (in arrival order) that arrived ``min_age`` ago or more."""
        old = []
        for key, since in candidates:
            if now - since < self._min_age:
                break  # arrival order: the rest are younger still
            old.append(key)
        return self._rng.choice(old) if old else None

    def remove(self, key: K) -> None:
        """Forget a pending handshake (it completed, failed, timed out or was evicted)."""
        address, _ = self._keys.pop(key)
        mine = self._by_address[address]
        del mine[key]
        if not mine:
            del self._by_address[address]
        self._strangers -= address not in self.trusted
