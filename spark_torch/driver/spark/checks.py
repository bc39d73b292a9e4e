"""The cluster checks ``run()`` and ``spark-torch doctor`` share: one table, so that the two
always agree. Each :class:`ClusterCheck` is a row of doctor's report (its name, value, verdict
and fix) and what a run does about it: a ``FAIL`` is the error a run raises before anything
starts, a ``WARN`` the warning it logs (once), an ``OK`` nothing."""

from __future__ import annotations

from dataclasses import dataclass

from spark_torch.base.states import ValueEnum
from spark_torch.driver.spark.cluster import IGNORE_SSL_KEY, ClusterInfo, unencrypted_rpc_warning

__all__ = ["Verdict", "ClusterCheck", "encryption_checks", "tls_check"]

_RPC_KEYS = "set spark.authenticate=true and spark.network.crypto.enabled=true"


class Verdict(ValueEnum):
    """What a check found: fine, worth a warning (a run goes on), or a blocker (a run is refused)."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class ClusterCheck:
    """One shared check: doctor prints ``name``, ``value`` and, unless OK, ``fix``; a run raises
    (FAIL) or logs (WARN) ``message``."""

    name: str
    value: str
    verdict: Verdict = Verdict.OK
    message: str = ""
    fix: str = ""


def tls_check(cluster: ClusterInfo) -> ClusterCheck:
    """``spark.ssl.enabled``: refused unless ``pytorch.spark.distributor.ignoreSsl`` (as
    TorchDistributor does), since torch's own traffic is not encrypted."""
    name = "TLS (spark.ssl.enabled)"
    if not cluster.ssl_enabled:
        return ClusterCheck(name, "off")
    if not cluster.ignore_ssl:
        return ClusterCheck(
            name,
            "on",
            Verdict.FAIL,
            "this Spark cluster requires encryption (spark.ssl.enabled), but torch's gloo/NCCL traffic between ranks "
            f"is not encrypted. If the network between executors is trusted, set {IGNORE_SSL_KEY}=true in the Spark "
            "conf to run anyway",
            f"torch traffic is not encrypted; set {IGNORE_SSL_KEY}=true to run anyway",
        )
    return ClusterCheck(
        name,
        f"on ({IGNORE_SSL_KEY}=true)",
        Verdict.WARN,
        "spark_torch: Spark encrypts its own traffic (spark.ssl.enabled); spark_torch's channel (logs, reports, "
        "results) is encrypted too, but torch's gloo/NCCL traffic between ranks is NOT encrypted",
        "keep the ranks on a trusted network",
    )


def _rpc_check(cluster: ClusterInfo) -> ClusterCheck:
    """``spark.network.crypto.enabled``: off on a real cluster, the run's channel secret crosses
    the network in clear (a warning); on, torch's own traffic still is not encrypted (a warning,
    unless the TLS row already said so)."""
    name = "RPC encryption (spark.network.crypto.enabled)"
    if cluster.crypto_enabled:
        value = "on (spark_torch's channel is encrypted; gloo/NCCL traffic is not)"
        if cluster.ssl_enabled:  # the TLS row says it
            return ClusterCheck(name, value)
        return ClusterCheck(
            name,
            value,
            Verdict.WARN,
            "spark_torch: Spark encrypts its own traffic (spark.network.crypto.enabled); spark_torch's channel (logs, "
            "reports, results) is encrypted too, but torch's gloo/NCCL traffic between ranks is NOT encrypted",
            "keep the ranks on a trusted network",
        )
    warning = unencrypted_rpc_warning(cluster)
    if warning is None:
        why = "spark.ssl.rpc.enabled is on" if cluster.rpc_ssl_enabled else "a local master: tasks stay on this machine"
        return ClusterCheck(name, f"off ({why})")
    return ClusterCheck(name, "off", Verdict.WARN, warning, _RPC_KEYS)


def encryption_checks(cluster: ClusterInfo) -> list[ClusterCheck]:
    """The encryption rows of a distributed run on ``cluster`` (a local-mode run has none)."""
    return [tls_check(cluster), _rpc_check(cluster)]
