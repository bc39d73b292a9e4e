"""A node's end: :class:`NodeOutcome` parses back into the value that was sent (its failures
too), and the one seal (:mod:`spark_torch.shared.sealed`) that carries it over the channel, in a
task's rows and inside Spark's error text refuses what is tampered with, another run's, or
malformed, each with a clear error."""

from __future__ import annotations

import base64
import json

import pytest

from spark_torch.base.states import GroupState, Problem, ProblemKind, RankState, ShardSource, ShardUse, StopReason
from spark_torch.errors import RankFailure
from spark_torch.shared.node_outcome import NodeOutcome, failures_of
from spark_torch.shared.sealed import MARKER, SealError, find_sealed, seal, unseal

pytestmark = pytest.mark.unit

SECRET = b"s" * 32
FAILURE = RankFailure(rank=1, host="h", exc_type="ValueError", exc_message="bad batch", last_lines=("step 3",))
FAILED = NodeOutcome(
    GroupState.FAILED, {0: RankState.STOPPED, 1: RankState.FAILED}, failures=(FAILURE,), pickled={1: "cGlja2xl"}
)


def test_a_node_outcome_round_trips() -> None:
    end = NodeOutcome(GroupState.STOPPED, {0: RankState.FINISHED, 3: RankState.STOPPED}, StopReason.TIMEOUT)
    assert NodeOutcome.from_wire(end.to_wire()) == end
    assert NodeOutcome.from_wire(NodeOutcome().to_wire()) == NodeOutcome()
    dumped = NodeOutcome(
        GroupState.STOPPED, {3: RankState.STOPPED}, StopReason.TIMEOUT, {3: ("/logs/nccl_trace_rank_3",)}
    )
    assert NodeOutcome.from_wire(dumped.to_wire()) == dumped
    assert (
        NodeOutcome.from_wire({"ranks": {}, "dumps": {"1": ["x" * 10_000] * 20}}).dumps[1] == ("x" * 4096,) * 8
    )  # bounded
    problem = NodeOutcome(problem=Problem(ProblemKind.CONFIGURATION, "the DataFrame is empty"))
    assert NodeOutcome.from_wire(problem.to_wire()) == problem and not problem.finished and not problem.failed
    assert NodeOutcome(GroupState.SUCCEEDED).finished
    kept = NodeOutcome(GroupState.SUCCEEDED, {0: RankState.FINISHED}, shard=ShardUse(1, 500, ShardSource.REUSED))
    assert NodeOutcome.from_wire(kept.to_wire()) == kept
    assert NodeOutcome.from_wire(FAILED.to_wire()) == FAILED and FAILED.failed
    assert NodeOutcome.from_wire(FAILED.to_wire(pickled=False)).pickled == {}


def test_an_outcome_without_state_dumps_or_problem_reads_as_none() -> None:
    assert NodeOutcome.from_wire({"ranks": {"0": "stopped"}, "stop": None}) == NodeOutcome(ranks={0: RankState.STOPPED})


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {"ranks": []},
        {"ranks": {"0": "exploded"}},
        {"ranks": {"x": "finished"}},
        {"ranks": {}, "dumps": {"0": "/a/path"}},
        {"ranks": {}, "dumps": {"0": [1]}},
        {"ranks": {}, "dumps": []},
        {"ranks": {}, "state": "exploded"},
        {"ranks": {}, "problem": "LaunchError"},
        {"ranks": {}, "problem": ["Nope", "m"]},
        {"ranks": {}, "problem": ["LaunchError", 3]},
        {"ranks": {}, "shard": [0, 1]},
        {"ranks": {}, "shard": [0, -1, "kept"]},
        {"ranks": {}, "shard": [0, 1, "borrowed"]},
        {"ranks": {}, "shard": [True, 1, "kept"]},
        {"ranks": {}, "failures": {"rank": 1}},
        {"ranks": {}, "failures": [1]},
        {"ranks": {}, "pickled": {"1": 5}},
    ],
    ids=[f"malformed-{n}" for n in range(19)],
)
def test_a_malformed_node_outcome_is_refused(body: object) -> None:
    with pytest.raises(ValueError):
        NodeOutcome.from_wire(body)


def test_a_later_end_completes_a_failure_sent_at_once() -> None:
    first = NodeOutcome(GroupState.FAILED, failures=(FAILURE,), pickled={1: "cGlja2xl"})
    other = RankFailure(rank=0, host="h", exit_code=1)
    end = NodeOutcome(GroupState.FAILED, {0: RankState.FAILED, 1: RankState.FAILED}, failures=(other,))
    merged = end.after(first)
    assert merged.ranks == end.ranks and merged.failures == (other, FAILURE) and merged.pickled == {1: "cGlja2xl"}
    failures, pickled = failures_of([merged, FAILED])
    assert [f.rank for f in failures] == [0, 1] and pickled == {1: "cGlja2xl"}


@pytest.mark.parametrize("transport", ["channel", "row", "spark-text"])
def test_the_seal_round_trips_through_each_transport(transport: str) -> None:
    sealed = seal(2, FAILED, SECRET)
    assert sealed.isascii() and sealed.startswith(MARKER)
    if transport == "channel":  # the message's payload
        assert unseal(sealed, SECRET) == (2, FAILED)
    elif transport == "row":  # a task's row: bytes
        assert unseal(sealed.encode("ascii"), SECRET) == (2, FAILED)
    else:  # inside Spark's exception text, next to what the rank printed
        text = f"Job aborted.\nrank 1 on h failed: ValueError: bad batch\n{sealed}\n\tat org.apache.spark.X(Y.java:1)"
        assert find_sealed(text, SECRET) == {2: FAILED}


def test_a_tampered_blob_is_refused() -> None:
    sealed = seal(0, FAILED, SECRET)
    body = sealed[len(MARKER) + 1 : sealed.index(".")]
    data = json.loads(base64.b64decode(body))
    data["outcome"]["state"] = "succeeded"
    forged = sealed.replace(body, base64.b64encode(json.dumps(data).encode()).decode())
    with pytest.raises(SealError, match="does not verify with this run's secret"):
        unseal(forged, SECRET)
    assert find_sealed(forged, SECRET) == {}


def test_a_blob_from_another_run_is_refused() -> None:
    theirs = seal(0, FAILED, b"t" * 32)
    with pytest.raises(SealError, match=r"another run's"):
        unseal(theirs, SECRET)
    # in Spark's text: only this run's counts (a rank could print another run's, or a forged one)
    assert find_sealed(f"{theirs}\n{seal(1, FAILED, SECRET)}", SECRET) == {1: FAILED}


@pytest.mark.parametrize(
    "text",
    ["", "SPARK_TORCH_NODE_END<>SPARK_TORCH_NODE_END", "a rank's own text", f"{MARKER}<abc.def>{MARKER}"],
    ids=["empty", "no-body", "plain-text", "short-mac"],
)
def test_malformed_input_is_refused_with_a_clear_error(text: str) -> None:
    with pytest.raises(SealError, match="not a sealed node end"):
        unseal(text, SECRET)


def test_a_verified_blob_that_is_not_an_outcome_is_refused() -> None:
    import hashlib
    import hmac

    blob = base64.b64encode(json.dumps({"node": 0, "outcome": {"ranks": []}}).encode()).decode()
    mac = hmac.new(SECRET, b"spark-torch-node-end-v1" + blob.encode(), hashlib.sha256).hexdigest()
    with pytest.raises(SealError, match="not a node's outcome"):
        unseal(f"{MARKER}<{blob}.{mac}>{MARKER}", SECRET)


def test_a_seal_within_a_limit_leaves_the_pickles_behind_first() -> None:
    full = seal(0, FAILED, SECRET)
    cut = seal(0, FAILED, SECRET, limit=len(full) - 1)
    assert len(cut) < len(full) and unseal(cut, SECRET)[1].pickled == {}
    assert unseal(cut, SECRET)[1].failures == FAILED.failures
