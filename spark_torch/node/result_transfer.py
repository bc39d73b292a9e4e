"""Rank 0's result, from node 0 to the driver, and the rows a barrier task returns: both ends.

Distributed mode; one owner for the whole contract. A barrier task (node) returns Arrow rows of
:data:`RESULT_SCHEMA` (``node, seq, data``) through Spark:

=====================  ==============================================================
``seq >= 0``           a piece of rank 0's pickled result, through Spark (16 MiB each)
``OUTCOME_SEQ``        this node's :class:`~spark_torch.shared.node_outcome.NodeOutcome`, sealed
(:mod:`~spark_torch.shared.sealed`)
``HANDED_OVER_SEQ``    the result was moved into the driver's ``result_dir``; data = its size
``STREAMED_SEQ``       the result went over the channel into the driver's file; data = its size
``CHANNEL_ERROR_SEQ``  this node never reached the driver's channel; data = its last error
=====================  ==============================================================

How the result travels (the ``result_transfer`` setting): ``auto`` moves rank 0's result file
into the driver's ``result_dir`` when node 0 can write it (same host or shared filesystem: no
copy at all) and the directory is the driver's (private to this user, holding the random token
of :func:`prepare_result_dir` that only the run spec carries: a directory someone else made at
that path is never written), else streams it over the run's authenticated channel in binary frames
(:class:`StreamedResult` writes it on the driver), else sends it as rows through Spark;
``channel`` skips the file hand-over; ``spark`` always uses rows. The driver reads the rows
with :func:`read_stage` and gets the result bytes from :func:`assemble`. The bytes are only
unpickled (by the driver, :func:`spark_torch.driver.api.distributor`) when they came from a file
this run wrote, frames authenticated with the run's secret, or Spark's own result path.
"""

from __future__ import annotations

import hmac
import mmap
import os
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from spark_torch.errors import LaunchError
from spark_torch.shared import rank_files
from spark_torch.shared.node_outcome import NodeOutcome
from spark_torch.shared.rank_files import ResultBytes
from spark_torch.shared.sealed import SealError, seal, unseal
from spark_torch.shared.spec import RunSpec
from spark_torch.shared.workdir_files import WorkdirFiles

__all__ = [
    "prepare_result_dir",
    "RESULT_SCHEMA",
    "BulkSender",
    "deliver",
    "node_rows",
    "StreamedResult",
    "StageRows",
    "read_stage",
    "assemble",
]

RESULT_SCHEMA = "node int, seq int, data binary"
OUTCOME_SEQ = -1
HANDED_OVER_SEQ = -2
CHANNEL_ERROR_SEQ = -3
STREAMED_SEQ = -4
#: how long the channel may go without taking a piece of the result before Spark carries it
STREAM_STALL_SECONDS = 60.0
#: a piece of the result through Spark
CHUNK_SIZE = 16 * 1024 * 1024


class BulkSender(Protocol):
    """A node's channel as the result stream needs it (:class:`~spark_torch.channel.node_end.NodeChannel`)."""

    @property
    def usable(self) -> bool:
        """Whether the driver was reached (and the channel not given up)."""

    @property
    def bulk_piece(self) -> int:
        """The largest piece of binary data one message carries."""

    def send_bulk(self, header: dict[str, Any], data: memoryview, deadline: float) -> None:
        """Queue one piece (raises TimeoutError at ``deadline``, ConnectionError when closing)."""

    def drain(self, timeout: float) -> bool:
        """Wait until the driver acknowledged everything sent; False on timeout."""


def prepare_result_dir(path: str) -> str:
    """Driver side: mark the (0700) ``path`` as this run's result directory; returns the token
    for the run spec."""
    token = secrets.token_hex(16)
    fd = os.open(WorkdirFiles(path).result_token(), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(token)
    return token


# node side


def _is_the_drivers(result_dir: str, token: str) -> bool:
    """Whether ``result_dir`` is the driver's: a real directory (no symlink), owned by this
    user, private (no group/other access), holding ``token``."""
    if not token:
        return False
    try:
        info = os.lstat(result_dir)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return False
        fd = os.open(WorkdirFiles(result_dir).result_token(), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "r", encoding="ascii", errors="replace") as fh:
            return hmac.compare_digest(fh.read(64), token)
    except OSError:
        return False


def _hand_over(result_file: str, result_dir: str | None, token: str) -> int | None:
    """Move the result into the driver's ``result_dir`` if this host sees it; returns its size."""
    if not result_dir or not _is_the_drivers(result_dir, token) or not os.access(result_dir, os.W_OK):
        return None
    target = WorkdirFiles(result_dir).handed_over_result()
    try:
        size = os.path.getsize(result_file)
        try:
            os.replace(result_file, target)  # same filesystem: no copy
        except OSError:
            with open(result_file, "rb") as src:
                rank_files.write_atomic_from(target, src)
        return size
    except OSError:
        return None


def _stream(sender: BulkSender, path: str, timeout: float) -> bool:
    """Stream the file over the channel in authenticated binary frames; True once the driver
    acknowledged all of it (False: not connected, or no progress for ``timeout`` seconds)."""
    if not sender.usable:
        return False
    piece = sender.bulk_piece
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        # pieces are views of a memory map: the page cache goes to the socket without copies
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    # the map is unmapped when the last view of it is gone (pieces the client still holds for a
    # resend keep it alive; closing it here could pull pages from under them)
    view = memoryview(mapped) if mapped is not None else memoryview(b"")
    try:
        offset = 0
        while True:
            data = view[offset : offset + piece]
            sender.send_bulk({"offset": offset}, data, time.monotonic() + timeout)
            offset += data.nbytes
            if offset >= size:
                break
        return sender.drain(timeout)
    except (TimeoutError, ConnectionError):
        return False


def deliver(spec: RunSpec, result_file: str, sender: BulkSender | None) -> tuple[int, int] | None:
    """Node 0: rank 0's result straight to the driver, by file or over the channel.
    Returns (row kind, size), or None: then it travels as rows (:func:`node_rows`)."""
    transfer = spec.settings.result_transfer
    if transfer == "auto":
        size = _hand_over(result_file, spec.result_dir, spec.result_token)
        if size is not None:
            return HANDED_OVER_SEQ, size
    if transfer in ("auto", "channel") and sender is not None:
        if _stream(sender, result_file, STREAM_STALL_SECONDS):
            return STREAMED_SEQ, os.path.getsize(result_file)
    return None


def _row(node_rank: int, seq: int, data: Any) -> Any:
    """One Arrow row of RESULT_SCHEMA; ``data`` may be bytes or a pyarrow Buffer (not copied)."""
    import pyarrow as pa

    buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    offsets = pa.py_buffer(bytes(4) + len(buf).to_bytes(4, "little", signed=True))
    column = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, buf])
    return pa.RecordBatch.from_arrays(
        [pa.array([node_rank], pa.int32()), pa.array([seq], pa.int32()), column], names=["node", "seq", "data"]
    )


def _result_rows(node_rank: int, result_file: str) -> Iterator[Any]:
    """Rank 0's result through Spark's result channel, as 16 MiB Arrow rows."""
    with open(result_file, "rb") as fh:
        seq = 0
        while True:
            piece = fh.read(CHUNK_SIZE)
            if not piece and seq > 0:
                break
            yield _row(node_rank, seq, piece)
            seq += 1
            if len(piece) < CHUNK_SIZE:
                break


def node_rows(
    node_rank: int,
    outcome: NodeOutcome,
    secret: bytes,
    *,
    channel_error: str | None,
    delivered: tuple[int, int] | None,
    result_file: str | None,
) -> Iterator[Any]:
    """The rows a barrier task returns (see the module docstring)."""
    if channel_error:
        yield _row(node_rank, CHANNEL_ERROR_SEQ, channel_error.encode("utf-8"))
    yield _row(node_rank, OUTCOME_SEQ, seal(node_rank, outcome, secret).encode("ascii"))
    if not outcome.finished:
        return  # the driver asked this node to stop (timeout, Ctrl-C, another node failed)
    if delivered is not None:  # rank 0's result is already with the driver (file or channel)
        yield _row(node_rank, delivered[0], str(delivered[1]).encode("ascii"))
    elif result_file is not None:
        yield from _result_rows(node_rank, result_file)


# driver side


class StreamedResult:
    """Driver side of the stream: writes the pieces node 0 sends over the channel into ``path``
    (authenticated frames, in order, exactly once: the channel guarantees that)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        #: bytes written so far
        self.received = 0

    def piece(self, node: int, header: Any, data: Any) -> None:
        """One piece; raises ValueError for anything but the next piece of node 0."""
        if node != 0:
            raise ValueError(f"node {node} sent a result piece; only node 0 has rank 0's result")
        if not isinstance(header, dict) or not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError("a result piece needs a header object and binary data")
        offset = header.get("offset")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset != self.received:
            raise ValueError(f"a result piece at offset {offset!r}, expected {self.received}")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written
        self.received = offset

    def size(self) -> int:
        """Bytes received (the file is closed once asked)."""
        self.close()
        return self.received

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class StageRows:
    """What the barrier stage's rows say."""

    table: Any
    #: each node's outcome, as its row says (a row whose MAC does not verify is left out)
    outcomes: dict[int, NodeOutcome] = field(default_factory=dict)
    #: per node that never reached the channel, its last connection error
    channel_errors: dict[int, str] = field(default_factory=dict)


def read_stage(table: Any, secret: bytes) -> StageRows:
    """Parse the collected rows (a ``pyarrow.Table`` of :data:`RESULT_SCHEMA`)."""
    nodes = table.column("node").to_pylist()
    seqs = table.column("seq").to_pylist()
    data = table.column("data")
    errors = {
        node: data[i].as_py().decode("utf-8", errors="replace")
        for i, (node, seq) in enumerate(zip(nodes, seqs))
        if seq == CHANNEL_ERROR_SEQ
    }
    outcomes = {}
    for i, (node, seq) in enumerate(zip(nodes, seqs)):
        if seq == OUTCOME_SEQ:
            try:
                sealed_node, outcome = unseal(data[i].as_py(), secret)
            except SealError:
                continue  # not this run's: as if the node had said nothing
            if sealed_node == node:  # another node's end in this node's row says nothing either
                outcomes[node] = outcome
    return StageRows(table=table, outcomes=outcomes, channel_errors=errors)


def assemble(stage: StageRows, result_dir: str | None, streamed: StreamedResult | None) -> ResultBytes:
    """Rank 0's pickled result: from the file node 0 handed over or streamed over the channel,
    or joined from its Arrow rows (zero-copy views, one join)."""
    table = stage.table
    nodes = table.column("node").to_pylist()
    seqs = table.column("seq").to_pylist()
    data = table.column("data")
    kinds = (HANDED_OVER_SEQ, STREAMED_SEQ)
    rows = sorted(
        (seq, i) for i, (node, seq) in enumerate(zip(nodes, seqs)) if node == 0 and (seq >= 0 or seq in kinds)
    )
    if rows and rows[0][0] == STREAMED_SEQ:
        size = int(data[rows[0][1]].as_py().decode("ascii"))
        received = streamed.size() if streamed is not None else 0
        if received != size or streamed is None:
            raise LaunchError(
                f"rank 0's result: node 0 streamed {size} bytes over the channel, the driver has {received}"
            )
        return rank_files.map_file(streamed.path)
    if rows and rows[0][0] == HANDED_OVER_SEQ:
        size = int(data[rows[0][1]].as_py().decode("ascii"))
        path = WorkdirFiles(result_dir or "").handed_over_result()
        try:
            result = rank_files.map_file(path)
        except OSError as exc:
            raise LaunchError(f"rank 0's result file {path} could not be read on the driver ({exc})") from exc
        if len(result) != size:
            raise LaunchError(
                f"rank 0's result file {path} has {len(result)} bytes on the driver, node 0 wrote {size}; "
                "is the driver's temp directory on a filesystem that does not show other hosts' writes at once?"
            )
        return result
    pieces = [data[i].as_buffer() for seq, i in rows if seq >= 0]  # zero-copy views of Arrow memory
    joined = bytearray(sum(p.size for p in pieces))
    view = memoryview(joined)
    offset = 0
    for piece in pieces:
        view[offset : offset + piece.size] = memoryview(piece).cast("B")
        offset += piece.size
    return joined
