"""torch's Flight Recorder dumps (its JSON, ``_dump_fr_trace_json``): the tail a rank sends, and
what the driver reads from them.

A rank keeps only the newest entries of its dump (:func:`keep_tail`), so that a long run's record
(gloo records every collective: ~1,500 of them are over 512 KB) still fits one frame. The driver
reads each dump as untrusted text (:func:`read_dump`: bounded, every field type-checked, never a
raise) and compares the ranks (:func:`summary`): what each has in flight, which rank is behind
(``rank 1 is at #5, the others at #6``) and the first collective the ranks disagree on
(``collective #21: rank 0 all_reduce [4], rank 1 broadcast [4]``).

Fields read (torch 2.13, ``torch/csrc/distributed/c10d/FlightRecorder*``): ``entries`` with
``collective_seq_id``, ``profiling_name`` (``gloo:all_reduce``), ``process_group`` (``[uid,
desc]``), ``input_sizes``, ``state`` (``scheduled``/``started``/``completed``; gloo never leaves
``scheduled``) and ``retired`` (the collective completed; how gloo says so), ``is_p2p``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Entry", "Dump", "keep_tail", "read_dump", "rank_line", "summary", "DROPPED_KEY"]

#: what :func:`keep_tail` adds to a dump it cut: how many older entries it left out
DROPPED_KEY = "spark_torch_dropped_entries"
#: the group torch's default process group has in ``process_group``
DEFAULT_GROUP = "0"


@dataclass(frozen=True)
class Entry:
    """One collective of a rank, as read from its dump."""

    seq: int
    #: ``profiling_name`` without its backend (``all_reduce``)
    name: str
    #: ``profiling_name`` as torch wrote it (``gloo:all_reduce``)
    full_name: str
    group: str
    sizes: str
    in_flight: bool
    state: str
    p2p: bool


@dataclass(frozen=True)
class Dump:
    """A rank's dump: its entries, oldest first, and how many older ones the rank cut."""

    entries: tuple[Entry, ...]
    dropped: int = 0


def keep_tail(data: bytes, limit: int) -> bytes:
    """``data`` (a dump) if it fits ``limit`` bytes, else the same dump with only its newest
    entries that fit (and :data:`DROPPED_KEY`); ``data`` as it is if it is not a dump."""
    if len(data) <= limit:
        return data
    try:
        dump = json.loads(data)
        entries = dump["entries"]
        if not isinstance(entries, list):
            return data
        dump["entries"] = []
        dump[DROPPED_KEY] = 0
        room = limit - len(json.dumps(dump).encode()) - 16  # 16: the digits of the dropped count
    except (ValueError, TypeError, KeyError, RecursionError):
        return data
    kept = 0
    for entry in reversed(entries):
        size = len(json.dumps(entry).encode()) + 2  # ", " between entries
        if size > room:
            break
        room -= size
        kept += 1
    dump["entries"] = entries[len(entries) - kept :]
    dump[DROPPED_KEY] = len(entries) - kept
    return json.dumps(dump).encode()


def _text(value: object, limit: int = 60) -> str:
    return value[:limit] if isinstance(value, str) else "?"


def _sizes(value: object) -> str:
    """``[[4], [2, 3]]`` as ``[4], [2, 3]`` (bounded), ``?`` for anything else."""
    if not isinstance(value, list):
        return "?"
    shapes = []
    for shape in value[:8]:
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            return "?"
        shapes.append("[" + ", ".join(str(d) for d in shape[:8]) + ("..." if len(shape) > 8 else "") + "]")
    return ", ".join(shapes) + (", ..." if len(value) > 8 else "")


def _entry(item: object) -> Entry | None:
    if not isinstance(item, dict):
        return None
    seq = item.get("collective_seq_id")
    if not isinstance(seq, int) or isinstance(seq, bool):
        return None
    full = _text(item.get("profiling_name"))
    group = item.get("process_group")
    uid = _text(group[0], 40) if isinstance(group, list) and group else str(item.get("pg_id", "?"))[:40]
    state = _text(item.get("state"), 20)
    return Entry(
        seq=seq,
        name=full.split(":", 1)[-1],
        full_name=full,
        group=uid,
        sizes=_sizes(item.get("input_sizes")),
        in_flight=item.get("retired") is not True and state != "completed",
        state=state,
        p2p=item.get("is_p2p") is True,
    )


def read_dump(data: bytes) -> Dump | str:
    """A rank's dump, or why it is none (the text came from a rank: any shape, never a raise).
    The caller bounds ``data``'s size; JSON nesting too deep for Python is refused here."""
    try:
        dump = json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return "(not a Flight Recorder dump)"
    entries = dump.get("entries", []) if isinstance(dump, dict) else None  # none yet: torch leaves it out
    if not isinstance(entries, list):
        return "(not a Flight Recorder dump)"
    dropped = dump.get(DROPPED_KEY, 0)
    parsed = tuple(e for e in map(_entry, entries) if e is not None)
    return Dump(parsed, dropped if isinstance(dropped, int) and not isinstance(dropped, bool) else 0)


def rank_line(dump: Dump | str, shown: int = 3) -> str:
    """What one rank has in flight (the newest ``shown``), or its last collective."""
    if isinstance(dump, str):
        return dump
    # collectives of one group complete in order: one older than a retired one is done too
    # (gloo marks them retired a little after they return)
    done: dict[str, int] = {}
    for e in dump.entries:
        if not e.in_flight and not e.p2p:
            done[e.group] = max(done.get(e.group, 0), e.seq)
    active = [e for e in dump.entries if e.in_flight and (e.p2p or e.seq > done.get(e.group, 0))]
    if not active:
        last = dump.entries[-1] if dump.entries else None
        return "no collective in flight" + (f" (last: {last.full_name} #{last.seq}, completed)" if last else "")
    parts = [
        f"{e.full_name} #{e.seq} in flight{' (started)' if e.state == 'started' else ''}, sizes {e.sizes}"
        for e in active[-shown:]
    ]
    return "; ".join(parts) + (f" (+{len(active) - shown} earlier)" if len(active) > shown else "")


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _who_is_behind(group: str, positions: Mapping[int, int]) -> str | None:
    """``rank 1 is at #5, the others at #6`` when the ranks' last collectives differ."""
    by_seq: dict[int, list[int]] = {}
    for rank, seq in positions.items():
        by_seq.setdefault(seq, []).append(rank)
    if len(by_seq) < 2:
        return None
    order = sorted(by_seq.items())  # the furthest behind first
    largest = max(len(ranks) for _, ranks in order)
    majority = [seq for seq, ranks in order if len(ranks) == largest]
    where = f"group {group}: " if group != DEFAULT_GROUP else ""
    if len(majority) == 1 and largest > 1:
        odd = [(seq, ranks) for seq, ranks in order if seq != majority[0]]
        text = ", ".join(f"{_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} at #{seq}" for seq, ranks in odd)
        return f"{where}{text}, the others at #{majority[0]}"
    first, *rest = order
    text = f"{_ranks(first[1])} {'is' if len(first[1]) == 1 else 'are'} at #{first[0]}"
    return where + ", ".join([text] + [f"{_ranks(ranks)} at #{seq}" for seq, ranks in rest])


def _first_mismatch(group: str, by_rank: Mapping[int, Mapping[int, Entry]]) -> str | None:
    """``collective #21: rank 0 all_reduce [4], rank 1 broadcast [4]``: the earliest collective
    whose name or sizes differ between the ranks that recorded it."""
    seqs = sorted({seq for entries in by_rank.values() for seq in entries})
    for seq in seqs:
        kinds: dict[tuple[str, str], list[int]] = {}
        for rank, entries in by_rank.items():
            if seq in entries:
                kinds.setdefault((entries[seq].name, entries[seq].sizes), []).append(rank)
        if len(kinds) > 1:
            where = f"group {group} " if group != DEFAULT_GROUP else ""
            parts = [
                f"{_ranks(ranks)} {name} {sizes}"
                for (name, sizes), ranks in sorted(kinds.items(), key=lambda kv: kv[1])
            ]
            return f"{where}collective #{seq}: " + ", ".join(parts)
    return None


def summary(dumps: Mapping[int, Dump | str | None]) -> list[str]:
    """Lines for the ranks in ``dumps`` (None: the rank did not answer): who is behind, the first
    collective they disagree on, then each rank's line. A rank without a dump leaves the others'
    comparison intact."""
    read = {rank: dump for rank, dump in dumps.items() if isinstance(dump, Dump)}
    groups: dict[str, dict[int, dict[int, Entry]]] = {}
    for rank, read_one in read.items():
        groups.setdefault(DEFAULT_GROUP, {}).setdefault(rank, {})  # a rank with no collective yet is at #0
        for entry in read_one.entries:
            if not entry.p2p:
                groups.setdefault(entry.group, {}).setdefault(rank, {})[entry.seq] = entry
    lines = []
    for group, by_rank in sorted(groups.items()):
        if len(by_rank) < 2:
            continue
        behind = _who_is_behind(group, {rank: max(entries, default=0) for rank, entries in by_rank.items()})
        mismatch = _first_mismatch(group, by_rank)
        lines += [line for line in (mismatch, behind) if line]
    for rank, given in sorted(dumps.items()):
        text = "no trace (it did not answer)" if given is None else rank_line(given)
        if isinstance(given, Dump) and given.dropped:
            text += f" [{given.dropped} older entries cut]"
        lines.append(f"rank {rank}: {text}")
    return lines
