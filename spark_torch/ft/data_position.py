"""A DataFrame run's replica groups: which group trained each committed step (:class:`Ledger`).

In ``run_on_dataframe(..., replica_groups=G)`` a rank's :func:`~spark_torch.data.rank_loader`
hands out, at each step, the batch of torchft's committed step (:mod:`spark_torch.rank.step_batches`):
batch ``step % batches`` of epoch ``step // batches`` of the rank's own rows. A group that was down
while its peers committed steps heals at their step and goes on from there: the batches of the
steps it missed are not trained by it in that epoch. This module counts them, per group.

:func:`attach` (called by :mod:`spark_torch.ft.wiring` when a Manager is made in a rank of such a
run) keeps a :class:`Ledger` with the Manager:

- it reads every quorum torchft's Manager gets from its server (a proxy of the Manager's client):
  the groups in it (``replica_ids``, whose trailing digits are the group, as torchft reads them);
- at every step that commits (the Manager's ``should_commit``, wrapped on the instance), the groups
  that took part are the quorum's, less the ones that healed in it (newcomers since the previous
  quorum, as many as the quorum's members exceed ``num_participants()``); every other group skipped
  that step's batch;
- the ledger is part of the state a group heals from (``register_state_dict_fn``, plain data for
  :mod:`spark_torch.ft.safe_heal`), so a group restarted alone takes its peer's count, which
  includes the steps the group missed while it was down. Every group holds the same ledger.

The counts start when the ledger does: at the run's first step, or at the checkpoint's step when
every group restarted from a checkpoint. Imports torchft only through the Manager it is given.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from spark_torch.base.envnames import DATA_FILE, NUM_REPLICA_GROUPS, RANK, REPLICA_GROUP_ID
from spark_torch.reporting.api import count_skipped

__all__ = ["Ledger", "attach", "current", "group_of", "STATE_KEY"]

#: the key of the ledger in the state a group heals from
STATE_KEY = "spark_torch_data"


def group_of(replica_id: str) -> int:
    """The group of a torchft replica id (``spark_torch_group_1:UUID`` -> 1): its trailing digits
    before the ``:``, as torchft itself reads them (none: 0)."""
    name = str(replica_id).split(":", 1)[0]
    digits = len(name) - len(name.rstrip("0123456789"))
    return int(name[len(name) - digits :]) if digits else 0


class _Client:
    """The Manager's client to its server, passed through, keeping each quorum's groups."""

    def __init__(self, inner: Any, ledger: Ledger) -> None:
        self._inner = inner
        self._ledger = ledger

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._inner._quorum(*args, **kwargs)
        self._ledger.saw_quorum([group_of(r) for r in quorum.replica_ids])  # torchft's order: its recovery sources
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Ledger:
    """Per group, how many committed steps its rank of this rank's index (``group_rank``) did not
    train (``skipped``), the same in those ranks of every group; and how many quorums this rank started
    (a loader checks that a quorum came between two of its batches)."""

    def __init__(self, group: int, groups: int, manager: Any = None) -> None:
        self.group, self.groups = group, groups
        self._manager = weakref.ref(manager) if manager is not None else None
        self._lock = threading.Lock()
        self.skipped = [0] * groups
        #: the groups of the last quorum accounted (a newcomer after it healed, or joined)
        self.members: list[int] = []
        #: the next step to account (a step below it was accounted already)
        self.next: int | None = None
        self.quorums = 0
        self._last_quorum: list[int] | None = None
        self._reported = 0  # this group's count when it last took part
        self._missed = False  # a peer's ledger (a heal) counted steps this group was not in

    def started(self) -> None:
        """This rank's Manager starts a quorum (``start_quorum()``, before its thread computes it)."""
        with self._lock:
            self.quorums += 1

    def saw_quorum(self, groups: list[int]) -> None:
        """A quorum this rank's Manager got (from its thread that computes the quorum): its groups
        in torchft's order."""
        with self._lock:
            self._last_quorum = list(groups)

    def took_part(self, step: int, participants: int, rank: int, first_sync: bool) -> set[int]:
        """The groups whose rank ``rank`` trained committed step ``step`` (the last quorum's, with
        ``participants`` taking part). Not in the quorum: down. In it but healing: torchft zeroed its
        gradients, and so it did not train: at step 0 with torchft's ``init_sync`` (``first_sync``)
        every rank but the one it heals from (the quorum's ``rank % len``-th) heals; later the
        healing ones are the newcomers since the last quorum (as many as the members exceed
        ``participants``)."""
        quorum = self._last_quorum or []
        if not quorum:
            return set()
        if first_sync and step == 0 and participants == len(quorum):
            return {quorum[rank % len(quorum)]}
        healing = len(quorum) - participants
        newcomers = [g for g in quorum if g not in self.members] if self.members else []
        if healing > 0 and len(newcomers) == healing:
            return set(quorum) - set(newcomers)
        return set(quorum)

    def committed(self, step: int, participants: int, rank: int, first_sync: bool, mine: bool) -> None:
        """Step ``step`` committed; ``mine``: whether this rank took part (torchft's ``is_participating()``)."""
        with self._lock:
            if self._last_quorum is None or (self.next is not None and step < self.next):
                return
            took_part = self.took_part(step, participants, rank, first_sync)
            took_part = took_part | {self.group} if mine else took_part - {self.group}
            for g in range(self.groups):
                if g not in took_part:
                    self.skipped[g] += 1
            self.members, self.next = list(self._last_quorum), step + 1
            count, missed = self.skipped[self.group], self._missed
            if mine:
                self._reported, self._missed = count, False
        if mine and missed:
            self._announce(step, count)

    def _announce(self, step: int, count: int) -> None:
        """This group takes part again after its peers committed steps without it: say so, from its rank 0."""
        if os.environ.get(RANK, "0") == "0":
            print(
                f"spark_torch: replica group {self.group} takes part again at step {step}: its ranks have not "
                f"trained the batches of {count} committed step(s) in all (report() rows: skipped_batches)",
                file=sys.stderr,
                flush=True,
            )

    def mine(self) -> int:
        """The committed steps whose batch this rank did not train (its group's rows: rank 0's)."""
        with self._lock:
            return self.skipped[self.group]

    def state_dict(self) -> dict[str, Any]:
        """Plain data, for the state a peer heals from."""
        with self._lock:
            return {"skipped": list(self.skipped), "members": list(self.members), "next": self.next}

    def load_state_dict(self, state: Any) -> None:
        """A peer's ledger (a heal): it counted the steps this group missed."""
        if not isinstance(state, dict):
            return
        with self._lock:
            skipped = state.get("skipped")
            if isinstance(skipped, list) and len(skipped) == self.groups:
                self.skipped = [int(n) for n in skipped]
            self.members = [int(g) for g in state.get("members") or []]
            step = state.get("next")
            self.next = int(step) if isinstance(step, int) else None
            self._missed = self.skipped[self.group] > self._reported

    def current_step(self) -> int | None:
        """The Manager's committed step (None when it is gone)."""
        manager = self._manager() if self._manager is not None else None
        return int(manager.current_step()) if manager is not None else None


_current: Ledger | None = None


def current() -> Ledger | None:
    """The ledger of this rank's Manager (the newest one made), or None."""
    return _current


def attach(manager: Any, environ: Mapping[str, str] = os.environ) -> Ledger | None:
    """Keep a :class:`Ledger` with ``manager`` in a rank of a DataFrame run with replica groups
    (else nothing: None). Wraps the instance's client, ``start_quorum`` and ``should_commit`` and adds the ledger
    to the state a group heals from."""
    global _current
    group, groups = environ.get(REPLICA_GROUP_ID, ""), environ.get(NUM_REPLICA_GROUPS, "")
    if not environ.get(DATA_FILE) or not group.isdigit() or not groups.isdigit():
        return None
    ledger = Ledger(int(group), int(groups), manager)
    manager._client = _Client(manager._client, ledger)
    should_commit = manager.should_commit

    def counted(*args: Any, **kwargs: Any) -> bool:
        committed = bool(should_commit(*args, **kwargs))
        if committed:
            first_sync = bool(getattr(manager, "_init_sync", True)) and bool(
                getattr(manager, "_use_async_quorum", True)
            )
            ledger.committed(
                int(manager.current_step()) - 1,
                int(manager.num_participants()),
                int(getattr(manager, "_group_rank", 0)),
                first_sync,
                bool(manager.is_participating()),
            )
        return committed

    manager.should_commit = counted
    start_quorum = manager.start_quorum

    def started(*args: Any, **kwargs: Any) -> Any:
        ledger.started()  # counted at once: a batch drawn right after it is not the step's second
        return start_quorum(*args, **kwargs)

    manager.start_quorum = started
    manager.register_state_dict_fn(STATE_KEY, ledger.load_state_dict, ledger.state_dict)
    count_skipped(ledger.mine)  # report()'s rows: skipped_batches
    _current = ledger
    return ledger
