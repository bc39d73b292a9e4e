"""The table of every setting a user can turn, and its one resolution on the driver.

Each setting can be given three ways, the first that is set wins:

1. the :class:`~spark_torch.Distributor` keyword of the same name (also a ``DistributorConfig`` field);
2. the environment variable (of the driver process);
3. the Spark conf key (``SparkSession.builder.config(...)``, ``--conf``, ``spark-defaults.conf``);

else its default. :func:`resolve` reads them once, when ``run()`` starts, into one frozen
:class:`Settings`, which the run spec carries to the nodes; no other module reads these
variables or keys. ``docs/configuration.md`` is generated from :data:`SETTINGS`
(:func:`markdown_table`; a test keeps it in step).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_torch.errors import ConfigurationError

__all__ = [
    "Setting",
    "Settings",
    "SETTINGS",
    "resolve",
    "check_value",
    "markdown_table",
    "parse_ports",
    "parse_host_port",
    "RESULT_TRANSFERS",
    "STALL_ACTIONS",
    "WARM_START_IDLE_MAX",
]

RESULT_TRANSFERS = ("auto", "channel", "spark")
STALL_ACTIONS = ("warn", "fail")


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
        return host.strip("[]"), None
    first, last = parse_ports(port_text, source)
    if first != last:
        raise ConfigurationError(f"{source}={text!r}: give one port after the host, not a range")
    return host.strip("[]"), first


def _address(text: str, source: str) -> str:
    value = text.strip().strip("[]")
    if not value:
        raise ConfigurationError(f"{source} is empty; set it to an address of this machine")
    return value


def _how_many_seconds(text: str, source: str, *, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero_ok else value > 0):
        raise ConfigurationError(f"{source}={text!r} must be a number of seconds {'>=' if zero_ok else '>'} 0")
    return value


#: the longest ``warm_start_idle``: a template is a cache, not a service (and select() takes no longer timeout)
WARM_START_IDLE_MAX = 24 * 3600.0


def _idle_seconds(text: str, source: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= WARM_START_IDLE_MAX:  # also refuses nan and inf
        raise ConfigurationError(
            f"{source}={text!r} must be a number of seconds > 0 and <= {WARM_START_IDLE_MAX:g} (24 h)"
        )
    return value


def _seconds(text: str, source: str) -> float:
    return _how_many_seconds(text, source, zero_ok=False)


def _seconds_or_zero(text: str, source: str) -> float:
    return _how_many_seconds(text, source, zero_ok=True)


def _switch(text: str, source: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{source}={text!r} must be true or false (also 1/0, yes/no, on/off)")


def _stall_action(text: str, source: str) -> str:
    value = text.strip().lower()
    if value not in STALL_ACTIONS:
        raise ConfigurationError(
            f"{source}={text!r} is not valid; use 'warn' (the default: say where each rank is) or 'fail' "
            "(also stop the run)"
        )
    return value


def _transfer(text: str, source: str) -> str:
    value = text.strip().lower()
    if value not in RESULT_TRANSFERS:
        raise ConfigurationError(f"{source}={text!r} is not valid; use 'auto' (the default), 'channel' or 'spark'")
    return value


@dataclass(frozen=True)
class Setting:
    """One row of the table."""

    #: the Distributor keyword, DistributorConfig field and :class:`Settings` attribute
    name: str
    env: str
    conf: str
    #: the value when nothing sets it (None: derived, see ``doc``)
    default: Any
    #: text (from the environment or the Spark conf) -> value; raises ConfigurationError naming the source
    parse: Callable[[str, str], Any] = field(repr=False)
    #: what the value looks like, for the docs
    kind: str
    doc: str
    #: earlier names of ``env``, still read (with a DeprecationWarning) when ``env`` is not set
    old_env: tuple[str, ...] = ()


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "channel_host",
        "SPARK_TORCH_CHANNEL_HOST",
        "spark.torch.channel.host",
        None,
        parse_host_port,
        "host or host:port",
        "Address of the driver that the executors reach its channel at (rank output, rendezvous, "
        "reports, results). The `host:port` form is for NAT or published container ports. Default: "
        "`spark.driver.host`; for a Spark Connect client, this machine's address on the route to the server.",
        old_env=("SPARK_TORCH_LOG_HOST",),
    ),
    Setting(
        "channel_bind_address",
        "SPARK_TORCH_CHANNEL_BIND_ADDRESS",
        "spark.torch.channel.bindAddress",
        None,
        _address,
        "address",
        "Local address the channel listens on. Default: `spark.driver.bindAddress`, else "
        "`spark.driver.host` (Spark Connect client: the advertised host).",
        old_env=("SPARK_TORCH_LOG_BIND",),
    ),
    Setting(
        "channel_ports",
        "SPARK_TORCH_CHANNEL_PORTS",
        "spark.torch.channel.ports",
        None,
        parse_ports,
        "FIRST-LAST or PORT",
        "Ports the channel may listen on (for a firewall). Default: a port the OS chooses.",
    ),
    Setting(
        "rendezvous_timeout",
        "SPARK_TORCH_RENDEZVOUS_TIMEOUT",
        "spark.torch.rendezvous.timeout",
        60.0,
        _seconds,
        "seconds",
        "How long nodes wait to rendezvous through the channel before falling back to one Spark allGather round.",
    ),
    Setting(
        "heartbeat",
        "SPARK_TORCH_HEARTBEAT",
        "spark.torch.channel.heartbeat",
        2.0,
        _seconds,
        "seconds",
        "A quiet channel connection sends a heartbeat this often; one silent for 4 heartbeats is re-established.",
        old_env=("SPARK_TORCH_HEARTBEAT_SECONDS",),
    ),
    Setting(
        "result_transfer",
        "SPARK_TORCH_RESULT_TRANSFER",
        "spark.torch.result.transfer",
        "auto",
        _transfer,
        "auto, channel or spark",
        "How rank 0's result reaches the driver in distributed mode: `auto` (by file when node 0 sees the "
        "driver's temp directory, else over the channel, else through Spark), `channel` (the channel, else "
        "Spark) or `spark` (Spark's result path, bounded by `spark.driver.maxResultSize`).",
    ),
    Setting(
        "executor_wait",
        "SPARK_TORCH_EXECUTOR_WAIT",
        "spark.torch.executor.wait",
        60.0,
        _seconds_or_zero,
        "seconds",
        "On a cluster master, how long to wait for executors to register before failing with "
        "InsufficientSlotsError (0: do not wait).",
    ),
    Setting(
        "warm_start",
        "SPARK_TORCH_WARM_START",
        "spark.torch.warmStart.enabled",
        True,
        _switch,
        "true or false",
        "Fork ranks from a template process that has imported torch (a fresh interpreter per rank when off).",
    ),
    Setting(
        "elastic_wait",
        "SPARK_TORCH_ELASTIC_WAIT",
        "spark.torch.elastic.wait",
        30.0,
        _seconds_or_zero,
        "seconds",
        "Elastic runs (min_processes < num_processes): how long a restart waits for lost executors to come "
        "back before going on with fewer nodes, and how long slots for more nodes must stay free before "
        "elastic_grow restarts the run larger.",
    ),
    Setting(
        "ship_package",
        "SPARK_TORCH_SHIP_PACKAGE",
        "spark.torch.shipPackage.enabled",
        True,
        _switch,
        "true or false",
        "Distributed mode: send the driver's spark_torch to the executors (once per session and version, "
        "as a zip on their Python path), so they run the driver's code whether or not they have it "
        "installed. Off: the executors need the same version installed (checked when the nodes meet).",
    ),
    Setting(
        "warm_start_idle",
        "SPARK_TORCH_WARM_START_IDLE",
        "spark.torch.warmStart.idleTimeout",
        300.0,
        _idle_seconds,
        "seconds, at most 86400",
        "A warm-start template with no rank running exits after this long (it also exits with its "
        "owner: the driver in local mode, the executor in distributed mode). Runs that share a template "
        "each keep it this long after their own last rank: the longest wins, a shorter one never cuts it.",
    ),
    Setting(
        "stall_timeout",
        "SPARK_TORCH_STALL_TIMEOUT",
        "spark.torch.stall.timeout",
        120.0,
        _seconds_or_zero,
        "seconds",
        "A run in which no rank made progress (its main thread computed, read or wrote, reached a new line, "
        "or called report(); waiting in a loop is none) for this long is stalled: spark_torch logs every "
        "rank's stack, grouped (0: no stall detection).",
    ),
    Setting(
        "stall_action",
        "SPARK_TORCH_STALL_ACTION",
        "spark.torch.stall.action",
        "warn",
        _stall_action,
        "warn or fail",
        "What a stall does: `warn` logs where each rank is (once; then one line per stall_timeout, the "
        "stacks again when one changed, and one line when the run moves again); `fail` also stops the "
        "attempt with RunStalledError (a failure for max_restarts).",
    ),
    Setting(
        "stall_all_threads",
        "SPARK_TORCH_STALL_ALL_THREADS",
        "spark.torch.stall.allThreads",
        False,
        _switch,
        "true or false",
        "Stall messages show every thread of each rank, not only its main thread.",
    ),
    Setting(
        "stall_source_lines",
        "SPARK_TORCH_STALL_SOURCE_LINES",
        "spark.torch.stall.sourceLines",
        True,
        _switch,
        "true or false",
        "Stall and timeout messages show each frame's source line (false: file, line and function "
        "only; the node leaves the lines out before a stack leaves it, see docs/security.md).",
    ),
    Setting(
        "spark_logs",
        "SPARK_TORCH_SPARK_LOGS",
        "spark.torch.sparkLogs.enabled",
        False,
        _switch,
        "true or false",
        "Keep Spark's own task-failure logs on the console while a run's Spark jobs are active (a Java "
        "trace per failed or killed task: `Executor`, `TaskSetManager`...). Off: those loggers are quiet "
        "for the run and restored after it (exactly as they were, also after a Ctrl-C); the run's error says "
        "what failed. They are the driver's loggers, for every job: a Spark job of your own that fails in "
        "another thread during a run prints no Java trace either (its exception still reaches your code).",
    ),
)

_BY_NAME = {s.name: s for s in SETTINGS}


@dataclass(frozen=True)
class Settings:
    """The resolved value of every setting for one run (see :data:`SETTINGS`; the defaults are
    the table's, :meth:`defaults`)."""

    channel_host: tuple[str, int | None] | None
    channel_bind_address: str | None
    channel_ports: tuple[int, int] | None
    rendezvous_timeout: float
    heartbeat: float
    result_transfer: str
    executor_wait: float
    warm_start: bool
    elastic_wait: float
    ship_package: bool
    warm_start_idle: float
    stall_timeout: float
    stall_action: str
    stall_all_threads: bool
    stall_source_lines: bool
    spark_logs: bool

    @classmethod
    def defaults(cls) -> Settings:
        """Every setting at its default."""
        return resolve({}, {}, {})


def check_value(name: str, value: Any) -> Any:
    """A value given as a Distributor keyword, checked and normalised like the text forms
    (a string goes through the same parser; ports may also be a ``(first, last)`` pair)."""
    setting = _BY_NAME[name]
    if value is None:
        return None
    if isinstance(value, str):
        return setting.parse(value, name)
    if setting.parse is parse_ports and isinstance(value, int) and not isinstance(value, bool):
        return parse_ports(str(value), name)
    if setting.parse is parse_ports and isinstance(value, (tuple, list)) and len(value) == 2:
        return parse_ports(f"{value[0]}-{value[1]}", name)
    if (
        setting.parse in (_seconds, _seconds_or_zero, _idle_seconds)
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    ):
        return setting.parse(str(value), name)
    if setting.parse is _switch and isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be {setting.kind}, got {value!r} ({type(value).__name__})")


def resolve(given: Mapping[str, Any], environ: Mapping[str, str], conf: Mapping[str, str]) -> Settings:
    """Every setting's value: ``given`` (checked keyword values, None = not given), else the
    environment, else the Spark conf, else the default."""
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        values[setting.name] = setting.default
        value = given.get(setting.name)
        if value is None and setting.env in environ:  # set but empty is an error, not "unset"
            value = setting.parse(environ[setting.env], setting.env)
        for old in setting.old_env:
            if value is None and old in environ:
                warnings.warn(
                    f"{old} is deprecated; set {setting.env} (the name of the `{setting.name}` setting) instead",
                    DeprecationWarning,
                    stacklevel=3,
                )
                value = setting.parse(environ[old], old)
        if value is None and conf.get(setting.conf) is not None:
            value = setting.parse(str(conf[setting.conf]), setting.conf)
        if value is not None:
            values[setting.name] = value
    return Settings(**values)


def markdown_table() -> str:
    """The table of settings as Markdown (the body of ``docs/configuration.md``)."""
    rows = [
        "| Distributor keyword | environment variable | Spark conf key | value | default | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        default = (
            "derived"
            if s.default is None
            else f"`{str(s.default).lower() if isinstance(s.default, bool) else s.default}`"
        )
        old = "".join(f" (formerly `{name}`, still read)" for name in s.old_env)
        rows.append(f"| `{s.name}` | `{s.env}`{old} | `{s.conf}` | {s.kind} | {default} | {s.doc} |")
    return "\n".join(rows) + "\n"
