"""Storage credentials stay out of everything spark_torch shows or starts: errors that quote a
storage option (in a cause's ``OSError.filename``, a custom ``__str__``, a note) reach the user
as new exceptions with ``***`` and no cause chain that holds the value, and nothing printed or
logged quotes it; nor does what an error only holds (its ``repr()``, its attributes, its
pickle: a ``__str__`` that hides its args, an HTTP error's request headers), nor a URL-quoted
value; ``SPARK_TORCH_STORAGE_OPTIONS`` is in no rank's, warm-start template's or reaper's
``/proc/PID/environ``, and every ``spark-torch`` command drops it from its own environment
before Spark starts."""

from __future__ import annotations

import http.server
import importlib
import json
import logging
import os
import pickle
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
from fsspec import register_implementation
from fsspec.spec import AbstractFileSystem

from spark_torch import ConfigurationError, Distributor
from spark_torch.base import envnames
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
    "filename": _in_filename,
    "str": _in_str,
    "note": _in_note,
    "cause": _in_a_cause,
}


def _user_gets(make: Callable[[], BaseException]) -> BaseException:
    with pytest.raises(Exception) as info:
        with options_withheld(OPTIONS):
            raise make()
    return info.value


def _everything_it_shows(exc: BaseException) -> str:
    """Its traceback (chain and notes), repr, and whatever its chain still holds: args,
    attributes, pickle (as the driver would get it from a rank)."""
    parts = ["".join(traceback.format_exception(exc)), repr(exc), repr(getattr(exc, "__notes__", None))]
    link: BaseException | None = exc
    while link is not None:
        parts += [repr(link), repr(link.args), repr(vars(link)) if hasattr(link, "__dict__") else ""]
        parts += [repr(getattr(link, name, None)) for name in ("filename", "filename2", "strerror")]
        try:
            parts.append(pickle.dumps(link).decode("latin-1"))
        except Exception:  # noqa: BLE001 - what does not pickle does not travel pickled
            pass
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
    assert str(clean).startswith(
        "the upload failed <- caused by PermissionError: [Errno 13] Access denied: '/bucket/***/run'"
    )
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


class HiddenArgsError(Exception):
    """A backend's error whose ``__str__`` leaves out its args: only repr and pickle show them."""

    def __str__(self) -> str:
        return "request refused"


#: a token as URL paths and queries change it (``/`` and ``+`` quoted)
SLASHED = f"tok/{uuid.uuid4().hex}+x="


def _in_args() -> BaseException:
    return HiddenArgsError("refused", SECRET)


def _url_quoted() -> BaseException:
    from urllib.parse import quote, quote_plus

    return PermissionError(13, "Access denied", f"https://store/{quote(SLASHED, safe='')}?k={quote_plus(SLASHED)}")


@pytest.mark.parametrize(
    ("make", "options", "secret"),
    [(_in_args, OPTIONS, SECRET), (_url_quoted, {"token": SLASHED}, SLASHED)],
    ids=["hidden-args", "url-quoted"],
)
def test_an_error_holding_an_option_where_a_traceback_does_not_show_is_replaced(
    make: Callable[[], BaseException], options: dict[str, Any], secret: str
) -> None:
    """(a) a ``__str__`` that hides its args: the value is in ``repr()`` and the pickle; (b) a
    URL-quoted value (``%2F``, ``%2B``): the clean error holds neither, in any form."""
    from urllib.parse import quote, quote_plus

    forms = {secret, quote(secret, safe=""), quote_plus(secret)}
    assert any(form in _everything_it_shows(make()) for form in forms)  # planted
    with pytest.raises(Exception) as info:
        with options_withheld(options):
            raise make()
    shown = _everything_it_shows(info.value)
    assert not [form for form in forms if form in shown], shown
    assert type(info.value) is type(make()) and info.value.__cause__ is None and info.value.__context__ is None
    assert "***" in shown or str(info.value) == "request refused"


def raise_a_hidden_args_error(options: dict[str, Any]) -> None:
    """In a rank: a storage call whose error hides the credential in its args."""
    with options_withheld(options):
        raise HiddenArgsError("refused", SECRET)


def test_a_ranks_error_pickled_to_the_driver_holds_no_credential(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], no_leftovers: None
) -> None:
    """(a) through a rank: its error report (text and pickle) reaches the driver clean."""
    caplog.set_level(logging.DEBUG)
    with pytest.raises(Exception, match="request refused") as info:
        Distributor(num_processes=1).run(raise_a_hidden_args_error, OPTIONS)
    shown = _everything_it_shows(info.value)
    out, err = capfd.readouterr()
    for where, text in {"the error": shown, "the logs": caplog.text, "stdout": out, "stderr": err}.items():
        assert SECRET not in text, f"the storage credential shows in {where}"


class _Forbidden(http.server.BaseHTTPRequestHandler):
    def _deny(self) -> None:
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _deny

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def forbidding_store() -> Iterator[str]:
    """An HTTP store on loopback that answers 403 to everything."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forbidden)
    thread = threading.Thread(target=server.serve_forever, name="forbidding-store", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/runs"
    server.shutdown()
    server.server_close()


def test_an_http_stores_403_quotes_no_authorization_header(
    forbidding_store: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], no_leftovers: None
) -> None:
    """(c) fsspec's HTTP store with an ``Authorization`` header option: aiohttp's error holds
    the header in ``request_info.headers`` (and so in its repr and pickle)."""
    caplog.set_level(logging.DEBUG)
    options = {"client_kwargs": {"headers": {"Authorization": f"Bearer {SECRET}"}}}
    with pytest.raises(ConfigurationError, match="403, message='Forbidden'") as info:
        Distributor(num_processes=1, storage_path=forbidding_store, storage_options=options).run(print)
    shown = _everything_it_shows(info.value)
    out, err = capfd.readouterr()
    for where, text in {"the error": shown, "the logs": caplog.text, "stdout": out, "stderr": err}.items():
        assert SECRET not in text, f"the storage credential shows in {where}"


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
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "spark_torch.node.reaper_main" in " ".join(p.info["cmdline"] or [])
    ]
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
    seen = Distributor(num_processes=1, warm_start=warm, env=own_template, warm_start_idle=5).run(
        environments_seen, SECRET
    )
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


@pytest.mark.parametrize("argv", [["doctor"], ["run", "train.py"]], ids=["doctor", "run"])
def test_every_command_drops_the_variable_before_spark_starts(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """(d) the variable is gone from the command's environment when its Spark session (and JVM)
    is started, also for ``doctor``, which reads no storage."""
    from spark_torch.errors import LaunchError

    cli_main = importlib.import_module("spark_torch.cli.main")
    seen: list[str | None] = []

    def no_session(*args: Any, **kwargs: Any) -> None:
        seen.append(os.environ.get(envnames.STORAGE_OPTIONS))
        raise LaunchError("no Spark in this test")

    monkeypatch.setattr(cli_main, "_session", no_session)
    monkeypatch.setenv(envnames.STORAGE_OPTIONS, json.dumps(OPTIONS))
    assert cli_main.main([*argv[:1], "--master", "local[1]", *argv[1:]]) != 0
    assert seen == [None]
