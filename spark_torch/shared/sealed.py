"""The one seal of a node's end: a :class:`~spark_torch.shared.node_outcome.NodeOutcome` as one
line of text, authenticated with the run's secret, the same for its three ways to the driver.

A barrier task sends its outcome over the run's channel when the driver is reached, returns it as
one of its task's rows, and, when it fails, raises it inside its task exception, whose text Spark
hands to the driver. One encoder (:func:`seal`) and one decoder (:func:`unseal`) serve all three;
:func:`find_sealed` only finds the sealed lines inside Spark's error text. That text also holds
whatever a failing rank printed or raised, so a sealed line counts only if its HMAC, keyed with the
run's secret (which ranks never see), verifies: nothing a rank can influence is trusted, and the
pickled exceptions an outcome carries are unpickled only when it verified.

The line: ``MARKER<base64 of {"node": n, "outcome": ...}.hex HMAC-SHA256>MARKER`` (ASCII only, so
it survives Spark's text, a row's bytes and a channel frame alike).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re

from spark_torch.shared.node_outcome import NodeOutcome

__all__ = ["MARKER", "SealError", "seal", "unseal", "find_sealed"]

MARKER = "SPARK_TORCH_NODE_END"
_LABEL = b"spark-torch-node-end-v1"
_PATTERN = re.compile(MARKER + r"<([A-Za-z0-9+/=]+)\.([0-9a-f]{64})>" + MARKER)
#: the shares of the failures' text bounds tried, after the full one, to fit a ``limit``
_SHARES = tuple(4.0**-n for n in range(6))


class SealError(ValueError):
    """A sealed node end that is refused: malformed, altered, another run's, or not an outcome."""


def _mac(secret: bytes, blob: str) -> str:
    return hmac.new(secret, _LABEL + blob.encode("ascii"), hashlib.sha256).hexdigest()


def _line(node: int, body: dict[str, object], secret: bytes) -> str:
    data = json.dumps({"node": node, "outcome": body}, separators=(",", ":")).encode("utf-8")
    blob = base64.b64encode(data).decode("ascii")
    return f"{MARKER}<{blob}.{_mac(secret, blob)}>{MARKER}"


def seal(node: int, outcome: NodeOutcome, secret: bytes, limit: int | None = None) -> str:
    """Node ``node``'s ``outcome`` as one sealed line. With ``limit`` (characters: a channel
    frame's room), the pickled exceptions stay behind first, then every failure's text gets a
    smaller share of its bounds (head and tail kept) until the line fits; the smallest is returned
    when none does (the channel then refuses it as too large)."""
    line = _line(node, outcome.to_wire(), secret)
    if limit is None or len(line) <= limit:
        return line
    for share in _SHARES:
        line = _line(node, outcome.to_wire(share, pickled=False), secret)
        if len(line) <= limit:
            break
    return line


def _open(blob: str, mac: str, secret: bytes) -> tuple[int, NodeOutcome]:
    if not hmac.compare_digest(mac, _mac(secret, blob)):
        raise SealError("a node's end does not verify with this run's secret (altered, or another run's)")
    try:
        data = json.loads(base64.b64decode(blob, validate=True).decode("utf-8"))
        node = data["node"]
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise ValueError("its node must be a non-negative int")
        return node, NodeOutcome.from_wire(data["outcome"])
    except (ValueError, TypeError, KeyError, binascii.Error) as exc:
        raise SealError(f"a sealed node end that is not a node's outcome: {type(exc).__name__}: {exc}") from None


def unseal(sealed: str | bytes, secret: bytes) -> tuple[int, NodeOutcome]:
    """The node and the outcome of one sealed line (as :func:`seal` made it: a channel message, a
    task's row); raises :class:`SealError` for anything else, or one that does not verify."""
    text = sealed.decode("ascii", errors="replace") if isinstance(sealed, bytes) else sealed
    match = _PATTERN.fullmatch(text.strip())
    if match is None:
        raise SealError(f"not a sealed node end (it must be {MARKER}<data.mac>{MARKER}): {text[:60]!r}")
    return _open(match.group(1), match.group(2), secret)


def find_sealed(text: str, secret: bytes) -> dict[int, NodeOutcome]:
    """Every node end sealed inside ``text`` (Spark's error text) that verifies, by node (the
    first of a node counts); forged, altered, cut or other runs' lines are ignored."""
    found: dict[int, NodeOutcome] = {}
    for match in _PATTERN.finditer(text):
        try:
            node, outcome = _open(match.group(1), match.group(2), secret)
        except SealError:
            continue
        found.setdefault(node, outcome)
    return found
