"""Where the driver's channel listens and what address it tells the nodes (resolved once).

From the run's :class:`~spark_torch.settings.Settings` and the Spark conf, the same in classic
and Spark Connect sessions:

- advertised host: the ``channel_host`` setting (``host`` or ``host:port``, IPv6 as
  ``[addr]:port``; the port form is for NAT/port mapping, e.g. a container whose published port
  differs), else ``spark.driver.host`` (classic), else, for a Connect client, the address of
  this machine's interface that routes to the Connect server;
- bind address: the ``channel_bind_address`` setting, else ``spark.driver.bindAddress``, else
  ``spark.driver.host`` (classic: what Spark itself binds), else, for a Connect client, the
  advertised host;
- ports (``channel_ports``), rendezvous deadline and heartbeat: from the settings.

The channel's secret reaches the nodes through Spark: a run warns once when Spark's RPC is not
encrypted on a cluster (:func:`~spark_torch.driver.spark.checks.encryption_checks`, when it is planned).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from spark_torch.driver.spark.cluster import ClusterInfo
from spark_torch.settings import Settings

__all__ = ["ChannelEndpoint", "resolve_endpoint", "route_address"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChannelEndpoint:
    """Resolved channel addresses and deadlines of one run."""

    bind_host: str
    advertise_host: str
    #: None: advertise the port actually bound
    advertise_port: int | None = None
    ports: tuple[int, int] | None = None
    rendezvous_timeout: float = 60.0
    heartbeat: float = 2.0


def route_address(remote_host: str) -> str:
    """This machine's address on the interface that routes to ``remote_host`` (no packet is sent).

    For a Spark Connect client this is the address the cluster most likely reaches it at;
    ``gethostbyname(gethostname())`` is 127.0.1.1 on Debian/Ubuntu and useless to executors.
    """
    host = remote_host.strip("[]")
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def resolve_endpoint(cluster: ClusterInfo, settings: Settings) -> ChannelEndpoint:
    """Bind address, advertised address, port range and deadlines of the channel (once per
    distributed run)."""
    port: int | None = None
    if settings.channel_host is not None:
        host, port = settings.channel_host
    elif cluster.is_connect:
        host = route_address(cluster.connect_host or "127.0.0.1")
    else:
        host = cluster.driver_host
    if settings.channel_bind_address:
        bind = settings.channel_bind_address
    elif cluster.is_connect:
        bind = host
    else:
        bind = cluster.driver_bind_address or cluster.driver_host
    return ChannelEndpoint(
        bind_host=bind.strip("[]"),
        advertise_host=host.strip("[]"),
        advertise_port=port,
        ports=settings.channel_ports,
        rendezvous_timeout=settings.rendezvous_timeout,
        heartbeat=settings.heartbeat,
    )
