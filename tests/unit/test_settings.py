"""The settings table: one resolution (keyword > environment > Spark conf > default), errors
that name the source, the docs generated from it, and env names typed once."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from spark_torch import ConfigurationError, Distributor, settings
from spark_torch.driver.config import DistributorConfig
from spark_torch.settings import SETTINGS, Settings, resolve
from spark_torch.shared.sealed import MARKER

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "spark_torch"


def test_every_setting_is_a_keyword_a_config_field_and_a_resolved_value() -> None:
    import dataclasses
    import inspect

    keywords = inspect.signature(Distributor.__init__).parameters
    assert keywords["settings"].kind is inspect.Parameter.VAR_KEYWORD  # the table's, by keyword
    fields = {f.name for f in dataclasses.fields(DistributorConfig)}
    resolved = {f.name for f in dataclasses.fields(Settings)}
    for setting in SETTINGS:
        assert setting.name not in keywords and setting.name in fields and setting.name in resolved, setting.name
        assert (
            getattr(Distributor(**{setting.name: setting.default})._config, setting.name) is not None
            or setting.default is None
        )
        assert setting.env.startswith("SPARK_TORCH_") and setting.conf.startswith("spark.torch."), setting
    assert resolved == {s.name for s in SETTINGS}
    assert len({s.env for s in SETTINGS}) == len({s.conf for s in SETTINGS}) == len(SETTINGS)


def test_precedence_keyword_then_environment_then_conf_then_default() -> None:
    env = {"SPARK_TORCH_RENDEZVOUS_TIMEOUT": "5", "SPARK_TORCH_CHANNEL_PORTS": "41000-41010"}
    conf = {
        "spark.torch.rendezvous.timeout": "7",
        "spark.torch.channel.heartbeat": "0.5",
        "spark.torch.warmStart.enabled": "false",
    }
    given = DistributorConfig(rendezvous_timeout=3).given_settings()
    got = resolve(given, env, conf)
    assert got.rendezvous_timeout == 3.0  # the keyword
    assert got.channel_ports == (41000, 41010)  # the environment
    assert got.heartbeat == 0.5 and got.warm_start is False  # the Spark conf
    assert got.result_transfer == "auto" and got.executor_wait == 60.0  # the defaults
    assert resolve({}, {}, {}) == Settings.defaults()
    assert Settings.defaults().rendezvous_timeout == next(s.default for s in SETTINGS if s.name == "rendezvous_timeout")


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("keyword", {"channel_ports": "9-1"}, "channel_ports='9-1' is not a port range"),
        ("keyword", {"result_transfer": "pigeon"}, "result_transfer='pigeon' is not valid"),
        ("keyword", {"warm_start": "maybe"}, "warm_start='maybe' must be true or false"),
        ("env", {"SPARK_TORCH_EXECUTOR_WAIT": "-1"}, "SPARK_TORCH_EXECUTOR_WAIT='-1' must be a number of seconds >= 0"),
        ("env", {"SPARK_TORCH_HEARTBEAT": ""}, "SPARK_TORCH_HEARTBEAT='' must be a number of seconds > 0"),
        (
            "conf",
            {"spark.torch.channel.host": "h:1-2"},
            "spark.torch.channel.host='h:1-2': give one port after the host",
        ),
        ("conf", {"spark.torch.result.transfer": "x"}, "spark.torch.result.transfer='x' is not valid"),
        # select() takes no timeout this large: the template stopped (issue 27)
        (
            "keyword",
            {"warm_start_idle": float("inf")},
            "warm_start_idle='inf' must be a number of seconds > 0 and <= 86400 (24 h)",
        ),
        (
            "keyword",
            {"warm_start_idle": 1e9},
            "warm_start_idle='1000000000.0' must be a number of seconds > 0 and <= 86400",
        ),
        (
            "env",
            {"SPARK_TORCH_WARM_START_IDLE": "nan"},
            "SPARK_TORCH_WARM_START_IDLE='nan' must be a number of seconds > 0",
        ),
        (
            "conf",
            {"spark.torch.warmStart.idleTimeout": "86401"},
            "spark.torch.warmStart.idleTimeout='86401' must be a number",
        ),
    ],
)
def test_bad_values_name_where_they_came_from(where: str, value: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        if where == "keyword":
            Distributor(**value)
        else:
            resolve({}, value if where == "env" else {}, value if where == "conf" else {})
    assert message in str(info.value)


def test_the_longest_idle_time_is_a_day() -> None:
    assert DistributorConfig(warm_start_idle=86400).warm_start_idle == settings.WARM_START_IDLE_MAX == 86400.0


def test_keyword_types() -> None:
    assert DistributorConfig(channel_ports=(40000, 40010)).channel_ports == (40000, 40010)
    assert DistributorConfig(channel_ports=40000).channel_ports == (40000, 40000)
    assert DistributorConfig(channel_host="[::1]:5").channel_host == ("::1", 5)
    assert DistributorConfig(warm_start=False).warm_start is False
    with pytest.raises(TypeError, match=r"heartbeat must be seconds, got \[1\]"):
        DistributorConfig(heartbeat=[1])


def test_configuration_page_is_generated_from_the_table() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    start = page.index("-->\n", page.index("<!-- generated from")) + len("-->\n")
    end = page.index("<!-- end of generated table -->")
    assert page[start:end] == settings.markdown_table(), (
        "docs/configuration.md is out of date; replace its table with the output of\n"
        "  python -c 'from spark_torch.settings import markdown_table; print(markdown_table(), end=\"\")'"
    )


def test_env_names_are_typed_once() -> None:
    """Our variables are named in envnames.py or the settings table, and imported elsewhere."""
    owners = {PACKAGE / "base" / "envnames.py", PACKAGE / "settings.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("SPARK_TORCH_"):
                if node.value.isupper() and " " not in node.value and node.value != MARKER:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not found, "env names re-typed outside envnames.py/settings.py:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "old, new, given, expected",
    [
        ("SPARK_TORCH_LOG_HOST", "SPARK_TORCH_CHANNEL_HOST", "10.0.0.5:7000", ("channel_host", ("10.0.0.5", 7000))),
        (
            "SPARK_TORCH_LOG_BIND",
            "SPARK_TORCH_CHANNEL_BIND_ADDRESS",
            "127.0.0.1",
            ("channel_bind_address", "127.0.0.1"),
        ),
        ("SPARK_TORCH_HEARTBEAT_SECONDS", "SPARK_TORCH_HEARTBEAT", "0.5", ("heartbeat", 0.5)),
    ],
)
def test_variables_are_named_after_their_keyword_old_names_still_read(
    old: str, new: str, given: str, expected: tuple[str, Any]
) -> None:
    name, value = expected
    assert next(s for s in settings.SETTINGS if s.name == name).env == new
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated; set {new}"):
        assert getattr(settings.resolve({}, {old: given}, {}), name) == value
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name: no warning, and it wins over the old one
        assert getattr(settings.resolve({}, {new: given}, {}), name) == value
    assert getattr(settings.resolve({}, {new: given, old: "garbage"}, {}), name) == value


def test_every_variable_is_named_after_its_keyword() -> None:
    for setting in settings.SETTINGS:
        assert setting.env == "SPARK_TORCH_" + setting.name.upper(), setting.env


def test_an_unknown_keyword_names_the_settings_there_are() -> None:
    with pytest.raises(TypeError, match=r"'stall_timout' \(did you mean 'stall_timeout'\?\).*warm_start_idle"):
        Distributor(stall_timout=3)


@pytest.mark.parametrize(
    ("keyword", "closest"),
    [
        ("num_proceses", "num_processes"),
        ("use_gpus", "use_gpu"),
        ("localmode", "local_mode"),
        ("max_restart", "max_restarts"),
        ("stall_timout", "stall_timeout"),
    ],
)
def test_a_misspelt_parameter_or_setting_says_which_was_meant_and_names_them_all(keyword: str, closest: str) -> None:
    with pytest.raises(TypeError) as caught:
        Distributor(**{keyword: 3})
    message = str(caught.value)
    assert message.startswith(
        f"Distributor() got unexpected keyword argument(s) {keyword!r} (did you mean {closest!r}?); "
    ), message
    assert (
        "its main parameters are num_processes, local_mode, use_gpu, its other parameters spark, env, timeout,"
        in message
    )
    assert "checkpoint_score_attribute" in message and "elastic_grow" in message
    assert f"and its settings {', '.join(s.name for s in settings.SETTINGS)} (docs/configuration.md)" in message


def test_an_unknown_keyword_with_no_close_name_gets_no_guess() -> None:
    with pytest.raises(
        TypeError,
        match=r"^Distributor\(\) got unexpected keyword argument\(s\) 'frobnicate'; its main parameters are num_processes",
    ):
        Distributor(frobnicate=1)


def test_the_default_stall_timeout_shows_a_hang_in_two_minutes_at_one_sample_a_second() -> None:
    """docs/troubleshooting.md: the default shows a hang about two minutes after it began, and
    samples once a second, the rate benchmarks/bench_stall.py measured (at 600 s, the same rate)."""
    from spark_torch.node.progress import sample_interval

    (stall,) = [s for s in SETTINGS if s.name == "stall_timeout"]
    assert stall.default == 120.0
    assert sample_interval(stall.default) == sample_interval(600.0) == 1.0
