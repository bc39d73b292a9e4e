"""Storage credentials stay out of everything spark_torch shows or starts: errors that quote a
storage option (in a cause's ``OSError.filename``, a custom ``__str__``, a note) reach the user
as new exceptions with ``***`` and no cause chain that holds the value, and nothing printed or
logged quotes it; ``SPARK_TORCH_STORAGE_OPTIONS`` is in no rank's, warm-start template's or
reaper's ``/proc/PID/environ``, and the ``spark-torch`` command drops it from its own
environment once read."""

from __future__ import annotations

import importlib
import json
import logging
import os
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
from fsspec import register_implementation
from fsspec.spec import AbstractFileSystem

from spark_torch import ConfigurationError, Distributor, envnames
from spark_torch.reporting.redaction import options_withheld, withheld

SECRET = "tok-" + uuid.uuid4().hex
OPTIONS = {"client_kwargs": {"token": SECRET}, "anon": False}


class BackendError(Exception):
    """A backend's error whose text comes from an attribute, not from its args."""

    def __init__(self, credentials: str) -> None:
        super().__init__("request refused")
        self.credentials = credentials

    def __str__(self) -> str:
        return f"request refused for credentials {self.credentials}"


def _in_filename() -> BaseException:
    return PermissionError(13, "Access denied", f"/bucket/{SECRET}/run")


def _in_str() -> BaseException:
    return BackendError(SECRET)


def _in_note() -> BaseException:
    error = TimeoutError("the store did not answer")
    error.add_note(f"retried with token {SECRET}")
    return error


def _in_a_cause() -> BaseException:
    """A clean-looking error whose causes hold the secret all three ways."""
    try:
        try:
            raise BackendError(SECRET)
        except BackendError as inner:
            raise _in_filename() from inner
    except PermissionError as middle:
        middle.add_note(f"retried with token {SECRET}")
        try:
            raise RuntimeError("the upload failed") from middle
        except RuntimeError as outer:
            return outer


PLANTED: dict[str, Callable[[], BaseException]] = {
    "filename": _in_filename, "str": _in_str, "note": _in_note, "cause": _in_a_cause,
}  # fmt: skip


def _user_gets(make: Callable[[], BaseException]) -> BaseException:
    with pytest.raises(Exception) as info:
        with options_withheld(OPTIONS):
            raise make()
    return info.value


def _everything_it_shows(exc: BaseException) -> str:
    """Its traceback (chain and notes), repr, and whatever its chain still holds."""
    parts = ["".join(traceback.format_exception(exc)), repr(exc), repr(getattr(exc, "__notes__", None))]
    link: BaseException | None = exc
    while link is not None:
        parts += [repr(link.args), repr(vars(link)) if hasattr(link, "__dict__") else ""]
        parts += [repr(getattr(link, name, None)) for name in ("filename", "filename2", "strerror")]
        link = link.__cause__ or link.__context__
    return "\n".join(parts)


@pytest.mark.parametrize("where", sorted(PLANTED))
def test_an_error_quoting_an_option_is_replaced_by_a_clean_one(where: str) -> None:
    original = PLANTED[where]()
    assert SECRET in "".join(traceback.format_exception(original))  # the planted secret shows
    clean = _user_gets(PLANTED[where])
    shown = _everything_it_shows(clean)
    assert SECRET not in shown, shown
    assert "***" in shown
    assert clean.__cause__ is None and clean.__context__ is None
    assert isinstance(clean, type(original)) or isinstance(clean, OSError)


def test_the_type_and_the_rest_of_the_text_are_kept() -> None:
    clean = _user_gets(_in_a_cause)
    assert type(clean) is RuntimeError
    assert str(clean).startswith("the upload failed <- caused by PermissionError: [Errno 13] Access denied: '/bucket/***/run'")
    assert "BackendError: request refused for credentials ***" in str(clean)
    assert _user_gets(_in_note).__notes__ == ["retried with token ***"]


def test_an_error_quoting_no_option_is_raised_unchanged() -> None:
    error = FileNotFoundError(2, "No such file", "/bucket/elsewhere")
    with pytest.raises(FileNotFoundError) as info:
        with options_withheld(OPTIONS):
            raise error
    assert info.value is error
    assert withheld(error, {}) is error


class LeakyFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """An fsspec backend that refuses to write and quotes its credentials three ways."""

    protocol = "leakytest"

    def __init__(self, client_kwargs: dict[str, str] | None = None, anon: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token = (client_kwargs or {}).get("token", "")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        raise _in_a_cause()


@pytest.fixture
def leaky_storage() -> Iterator[str]:
    register_implementation(LeakyFileSystem.protocol, LeakyFileSystem, clobber=True)
    yield f"{LeakyFileSystem.protocol}://bucket/runs"


def test_a_storage_error_quotes_no_credential_anywhere(
    leaky_storage: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], no_leftovers: None
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigurationError, match="cannot create the run's directory") as info:
        Distributor(num_processes=1, storage_path=leaky_storage, storage_options=OPTIONS).run(print)
    shown = _everything_it_shows(info.value)
    assert "Access denied: '/bucket/***/run'" in shown and "credentials ***" in shown
    out, err = capfd.readouterr()
    for where, text in {"the error": shown, "the logs": caplog.text, "stdout": out, "stderr": err}.items():
        assert SECRET not in text, f"the storage credential shows in {where}"


def environments_seen(secret: str) -> dict[str, Any]:
    """In a rank: where ``secret`` shows, among this rank's environment (as Python and as the
    kernel hold it), its parent's (the warm-start template, warm) and the node's reapers'."""
    def holds(pid: int | str) -> bool:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return secret.encode() in fh.read()

    reapers = [
        p.pid for p in psutil.process_iter(["cmdline"])
        if "spark_torch.node.reaper_main" in " ".join(p.info["cmdline"] or [])
    ]  # fmt: skip
    parent = psutil.Process(os.getppid())
    return {
        "os.environ": any(secret in v for v in os.environ.values()),
        "/proc/self/environ": holds("self"),
        "template": holds(parent.pid) if "spark_torch.node.template.server" in " ".join(parent.cmdline()) else None,
        "reapers": [holds(pid) for pid in reapers],
    }


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_the_clis_credential_variable_reaches_no_rank_template_or_reaper(
    warm: bool, monkeypatch: pytest.MonkeyPatch, no_leftovers: None
) -> None:
    """Set in the driver's environment (a user who exported it), it is scrubbed from every
    process spark_torch starts; a template is started for this test (its own startup key), so
    it is started while the driver's environment holds the variable."""
    monkeypatch.setenv(envnames.STORAGE_OPTIONS, json.dumps(OPTIONS))
    own_template = {"LC_SPARK_TORCH_TEST": uuid.uuid4().hex}
    seen = Distributor(num_processes=1, warm_start=warm, env=own_template, warm_start_idle=5).run(environments_seen, SECRET)
    assert seen["os.environ"] is False and seen["/proc/self/environ"] is False
    assert seen["template"] is (False if warm else None)
    assert seen["reapers"] and not any(seen["reapers"]), seen


def test_the_cli_drops_the_variable_once_read(monkeypatch: pytest.MonkeyPatch) -> None:
    cli_main = importlib.import_module("spark_torch.cli.main")
    monkeypatch.setenv(envnames.STORAGE_OPTIONS, json.dumps(OPTIONS))
    assert cli_main._given_storage_options(None) == OPTIONS
    assert envnames.STORAGE_OPTIONS not in os.environ
    monkeypatch.setenv(envnames.STORAGE_OPTIONS, json.dumps(OPTIONS))
    assert cli_main._given_storage_options('{"anon": true}') == {"anon": True}
    assert envnames.STORAGE_OPTIONS not in os.environ
