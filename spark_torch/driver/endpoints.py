"""Where the driver's channel listens and what address it tells the nodes (resolved once).

Precedence, the same in classic and Spark Connect sessions:

- advertised host: ``SPARK_TORCH_LOG_HOST`` (``host`` or ``host:port``, IPv6 as ``[addr]:port``;
  the port form is for NAT/port mapping, e.g. a container whose published port differs), else
  ``spark.driver.host`` (classic), else, for a Connect client, the address of this machine's
  interface that routes to the Connect server;
- bind address: ``SPARK_TORCH_LOG_BIND``, else ``spark.driver.bindAddress``, else
  ``spark.driver.host`` (classic: what Spark itself binds), else, for a Connect client, the
  advertised host;
- ports: ``SPARK_TORCH_CHANNEL_PORTS`` or ``spark.torch.channel.ports`` (``40000-40100`` or one
  port), else a port the OS chooses;
- rendezvous deadline: ``SPARK_TORCH_RENDEZVOUS_TIMEOUT`` or ``spark.torch.rendezvous.timeout``
  (seconds, default 60).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

from spark_torch.driver.cluster import ClusterInfo
from spark_torch.errors import ConfigurationError

__all__ = [
    "ChannelEndpoint",
    "resolve_endpoint",
    "parse_ports",
    "parse_host_port",
    "route_address",
    "LOG_HOST_ENV",
    "LOG_BIND_ENV",
    "PORTS_ENV",
    "PORTS_CONF",
    "RENDEZVOUS_TIMEOUT_ENV",
    "RENDEZVOUS_TIMEOUT_CONF",
]

LOG_HOST_ENV = "SPARK_TORCH_LOG_HOST"
LOG_BIND_ENV = "SPARK_TORCH_LOG_BIND"
PORTS_ENV = "SPARK_TORCH_CHANNEL_PORTS"
PORTS_CONF = "spark.torch.channel.ports"
RENDEZVOUS_TIMEOUT_ENV = "SPARK_TORCH_RENDEZVOUS_TIMEOUT"
RENDEZVOUS_TIMEOUT_CONF = "spark.torch.rendezvous.timeout"
HEARTBEAT_ENV = "SPARK_TORCH_HEARTBEAT_SECONDS"
DEFAULT_RENDEZVOUS_TIMEOUT = 60.0
DEFAULT_HEARTBEAT = 2.0


@dataclass(frozen=True)
class ChannelEndpoint:
    """Resolved channel addresses and deadlines of one run."""

    bind_host: str
    advertise_host: str
    #: None: advertise the port actually bound
    advertise_port: int | None = None
    ports: tuple[int, int] | None = None
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT
    heartbeat: float = DEFAULT_HEARTBEAT


def parse_ports(text: str, source: str) -> tuple[int, int]:
    """``"40000-40100"`` or ``"40000"`` -> an inclusive range; ConfigurationError naming ``source``."""
    low, sep, high = text.strip().partition("-")
    try:
        first = int(low)
        last = int(high) if sep else first
    except ValueError:
        first = last = -1
    if not 1 <= first <= last <= 65535:
        raise ConfigurationError(
            f"{source}={text!r} is not a port range; use FIRST-LAST with 1 <= FIRST <= LAST <= 65535 "
            "(e.g. 40000-40100) or a single port"
        )
    return first, last


def parse_host_port(text: str, source: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a bare IPv6 address."""
    value = text.strip()
    if not value:
        raise ConfigurationError(f"{source} is empty; set it to an address of this driver the executors can reach")
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise ConfigurationError(f"{source}={text!r} is not [IPv6]:port")
    elif value.count(":") == 1:
        host, port_text = value.split(":")
    else:  # a name, an IPv4 address, or a bare IPv6 address
        host, port_text = value, None
    if port_text is None:
        return host, None
    first, last = parse_ports(port_text, source)
    if first != last:
        raise ConfigurationError(f"{source}={text!r}: give one port after the host, not a range")
    return host, first


def _timeout(text: str, source: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigurationError(f"{source}={text!r} must be a number of seconds > 0")
    return value


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


def resolve_endpoint(cluster: ClusterInfo, environ: Mapping[str, str]) -> ChannelEndpoint:
    """Bind address, advertised address, port range and deadlines of the channel."""
    override = environ.get(LOG_HOST_ENV)
    port: int | None = None
    if override is not None:
        host, port = parse_host_port(override, LOG_HOST_ENV)
    elif cluster.is_connect:
        host = route_address(cluster.connect_host or "127.0.0.1")
    else:
        host = cluster.driver_host
    if environ.get(LOG_BIND_ENV):
        bind = environ[LOG_BIND_ENV]
    elif cluster.is_connect:
        bind = host
    else:
        bind = cluster.driver_bind_address or cluster.driver_host
    ports_text = environ.get(PORTS_ENV)
    ports = parse_ports(ports_text, PORTS_ENV) if ports_text else (
        parse_ports(cluster.channel_ports, PORTS_CONF) if cluster.channel_ports else None
    )
    timeout_text = environ.get(RENDEZVOUS_TIMEOUT_ENV)
    if timeout_text:
        rendezvous = _timeout(timeout_text, RENDEZVOUS_TIMEOUT_ENV)
    elif cluster.rendezvous_timeout:
        rendezvous = _timeout(cluster.rendezvous_timeout, RENDEZVOUS_TIMEOUT_CONF)
    else:
        rendezvous = DEFAULT_RENDEZVOUS_TIMEOUT
    heartbeat_text = environ.get(HEARTBEAT_ENV)
    heartbeat = _timeout(heartbeat_text, HEARTBEAT_ENV) if heartbeat_text else DEFAULT_HEARTBEAT
    return ChannelEndpoint(
        bind_host=bind.strip("[]"),
        advertise_host=host.strip("[]"),
        advertise_port=port,
        ports=ports,
        rendezvous_timeout=rendezvous,
        heartbeat=heartbeat,
    )
