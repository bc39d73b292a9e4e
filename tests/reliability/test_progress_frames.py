"""A node's progress snapshots (stall detection) over the real channel: one too large for a frame
arrives split per rank, a rank's stack too large on its own keeps its innermost calls, and while
the driver is unreachable only the latest snapshot waits."""

from __future__ import annotations

import threading
from typing import Any

from spark_torch.channel.node_end import NodeChannel
from spark_torch.channel.transport import WINDOW
from spark_torch.channel.wire import MAX_FRAME
from spark_torch.shared.stacks import RankStack

from ..netproxy import Proxy
from .channel_helpers import driver_channel, through, wait_for

#: how long the snapshots may take to arrive (reconnects included)
ARRIVE_SECONDS = 60.0


def _stack(rank: int, chars: int, mark: str = "") -> dict[str, Any]:
    """A rank's stack of about ``chars`` characters, its innermost call last."""
    outer = "".join(f'  File "train.py", line {i}, in step_{i}\n' for i in range(chars // 40))
    return RankStack(rank, f"{outer}  innermost call of rank {rank}{mark}", idle=3.0).to_dict()


def _received(driver: Any) -> list[tuple[int, Any]]:
    got: list[tuple[int, Any]] = []
    lock = threading.Lock()

    def on_progress(node: int, snapshot: Any) -> None:
        with lock:
            got.append((node, snapshot))

    driver.on_progress = on_progress
    return got


def test_a_snapshot_too_large_for_a_frame_arrives_split_per_rank() -> None:
    driver, _ = driver_channel()
    got = _received(driver)
    node = NodeChannel(driver.spec, 0, 1, threading.Event())
    try:
        # 34 ranks with all threads' stacks: ~1.4 MB, more than a frame; rank 33's alone is 2 MB
        stacks = [_stack(rank, 40_000) for rank in range(33)] + [_stack(33, 2 * MAX_FRAME)]
        node.send_progress(stacks)
        wait_for(
            "every rank's stack at the driver",
            lambda: {s["rank"] for _, snap in list(got) for s in snap} == set(range(34)),
            ARRIVE_SECONDS,
        )
        by_rank = {s["rank"]: s for _, snap in got for s in snap}
        assert len(got) > 1  # split: one frame could not hold them
        assert all(by_rank[r] == stacks[r] for r in range(33))  # those that fit arrive whole
        cut = by_rank[33]["text"]
        assert cut.startswith("...\n") and cut.endswith("innermost call of rank 33") and len(cut) < MAX_FRAME
        assert RankStack.from_dict(by_rank[33]).idle == 3.0
    finally:
        node.close(timeout=10)
        driver.close()


def test_only_the_latest_snapshot_waits_while_the_driver_is_unreachable() -> None:
    """The first connection is blackholed after the handshake (the driver unreachable: nothing is
    acknowledged) while the node takes 2,000 snapshots of ~50 KB (100 MB if all were kept); once
    the node reconnects, the driver gets the latest, and only a window of older ones."""
    driver, _ = driver_channel()
    got = _received(driver)
    proxy = Proxy(blackhole_after=4_000, faulty=1)
    node = NodeChannel(through(proxy, driver.spec), 0, 1, threading.Event())
    try:
        assert node.wait_attached(ARRIVE_SECONDS), "the node never reached the driver through the proxy"
        snapshots = 2_000
        for i in range(snapshots):
            node.send_progress([_stack(0, 50_000, mark=f" #{i}")])
        latest = f"innermost call of rank 0 #{snapshots - 1}"
        wait_for(
            "the latest snapshot at the driver",
            lambda: any(s["text"].endswith(latest) for _, snap in list(got) for s in snap),
            ARRIVE_SECONDS,
        )
        # at most the window sent into the blackhole (resent) and the latest
        assert len(got) <= WINDOW + 1, f"{len(got)} snapshots delivered: the node kept more than the latest"
    finally:
        node.close(timeout=10)
        proxy.close()
        driver.close()
