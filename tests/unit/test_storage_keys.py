"""The pickling rule, on a checkpoint alone (``reporting/storage_keys.py``): a checkpoint made
with storage options holds none of them (pickle, cloudpickle, copy, deepcopy, asdict, vars,
repr); in this process a copy or an unpickled pickle opens with the options while the original
lives; once it is gone the options must be given again, and an error says which, before the
storage is touched. The storage is a real fsspec filesystem that refuses any other secret."""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import pickle
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from fsspec import register_implementation
from fsspec.implementations.memory import MemoryFileSystem

from spark_torch import Checkpoint, ConfigurationError
from spark_torch.base import envnames
from spark_torch.reporting.storage_keys import StorageKey, options_from_text, restored_key

SECRET = "locked-secret-" + uuid.uuid4().hex
OPTIONS = {"secret": SECRET, "client_kwargs": {"region": "nowhere"}}


class LockedMemory(MemoryFileSystem):
    """fsspec's in-memory filesystem behind a secret: made with another one (or none), it refuses."""

    protocol = "lockedmem"
    cachable = False

    def __init__(self, secret: str | None = None, client_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if secret != SECRET:
            raise PermissionError(13, "access denied: wrong or no secret")
        super().__init__(**kwargs)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return str(MemoryFileSystem._strip_protocol(str(path).removeprefix("lockedmem://")))


@pytest.fixture
def stored(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A checkpoint's files in the locked store; yields its URL."""
    monkeypatch.delenv(envnames.STORAGE_OPTIONS, raising=False)
    register_implementation(LockedMemory.protocol, LockedMemory, clobber=True)
    url = f"lockedmem://bucket/{uuid.uuid4().hex}/checkpoint_000002"
    fs = LockedMemory(secret=SECRET)
    fs.pipe(f"{url}/state.txt", b"step 2")
    yield url
    fs.rm(url.rsplit("/", 1)[0], recursive=True)


def _shown(checkpoint: Any) -> dict[str, bytes]:
    """Everything a checkpoint gives away, by form."""
    return {
        "pickle": pickle.dumps(checkpoint),
        "cloudpickle": cloudpickle.dumps(checkpoint),
        "copy": pickle.dumps(copy.copy(checkpoint)),
        "deepcopy": pickle.dumps(copy.deepcopy(checkpoint)),
        "asdict": pickle.dumps(dataclasses.asdict(checkpoint)) + repr(dataclasses.asdict(checkpoint)).encode(),
        "vars": pickle.dumps(vars(checkpoint)) + repr(vars(checkpoint)).encode(),
        "repr": repr(checkpoint).encode(),
    }


def test_a_checkpoint_holds_no_storage_option(stored: str) -> None:
    checkpoint = Checkpoint(path=stored, step=2, storage_options=OPTIONS)
    leaked = sorted(form for form, data in _shown(checkpoint).items() if SECRET.encode() in data)
    assert leaked == []
    assert (
        "storage_options" not in vars(checkpoint) and checkpoint.storage_options is None
    )  # the InitVar's default: not kept


def test_copies_open_with_the_live_options(stored: str, tmp_path: Path) -> None:
    checkpoint = Checkpoint(path=stored, step=2, storage_options=OPTIONS)
    for i, same in enumerate(
        [
            copy.copy(checkpoint),
            copy.deepcopy(checkpoint),
            pickle.loads(pickle.dumps(checkpoint)),
            cloudpickle.loads(cloudpickle.dumps(checkpoint)),
            Checkpoint(**dataclasses.asdict(checkpoint)),
        ]
    ):
        assert (Path(same.to_directory(tmp_path / str(i))) / "state.txt").read_text() == "step 2"
    with checkpoint.as_directory() as directory:
        assert (Path(directory) / "state.txt").read_text() == "step 2"


def test_once_the_original_is_gone_the_options_are_asked_for(
    stored: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dump = pickle.dumps(Checkpoint(path=stored, step=2, storage_options=OPTIONS))
    gc.collect()
    orphan = pickle.loads(dump)
    before = set(os.listdir(os.environ.get("TMPDIR", "/tmp")))
    for open_it in (lambda: orphan.to_directory(), lambda: orphan.as_directory().__enter__()):
        with pytest.raises(ConfigurationError) as info:
            open_it()
        text = str(info.value)
        assert f"{stored} is on storage that its run opened with storage_options" in text
        assert "(storage_options={'client_kwargs': ..., 'secret': ...})" in text
        assert envnames.STORAGE_OPTIONS in text and "RunResult.from_path(..., storage_options=...)" in text
        assert SECRET not in text
    assert "checkpoint.to_directory(storage_options=" in str(
        pytest.raises(ConfigurationError, orphan.to_directory).value
    )
    assert set(os.listdir(os.environ.get("TMPDIR", "/tmp"))) == before  # no temporary directory left
    # given again: as an argument, or in the environment (JSON or @FILE)
    assert (Path(orphan.to_directory(tmp_path / "a", storage_options=OPTIONS)) / "state.txt").exists()
    with orphan.as_directory(storage_options=OPTIONS) as directory:
        assert (Path(directory) / "state.txt").exists()
    monkeypatch.setenv(envnames.STORAGE_OPTIONS, json.dumps(OPTIONS))
    assert (Path(orphan.to_directory(tmp_path / "b")) / "state.txt").exists()
    (tmp_path / "options.json").write_text(json.dumps(OPTIONS))
    monkeypatch.setenv(envnames.STORAGE_OPTIONS, f"@{tmp_path / 'options.json'}")
    assert (Path(orphan.to_directory(tmp_path / "c")) / "state.txt").exists()


def test_wrong_options_fail_in_the_backend_with_no_option_quoted(stored: str) -> None:
    orphan = Checkpoint(path=stored, step=2)
    with pytest.raises(PermissionError, match="wrong or no secret"):
        orphan.to_directory(storage_options={"secret": "not-" + SECRET})  # no key: the backend is asked
    assert "not-" + SECRET not in repr(
        pytest.raises(PermissionError, orphan.to_directory, storage_options={"secret": "not-" + SECRET}).value
    )


def test_fsspecs_own_configuration_counts_as_given(
    stored: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsspec.config import conf

    dump = pickle.dumps(Checkpoint(path=stored, step=2, storage_options=OPTIONS))
    gc.collect()
    monkeypatch.setitem(conf, LockedMemory.protocol, {"secret": SECRET})  # what FSSPEC_LOCKEDMEM_SECRET=... sets
    assert (Path(pickle.loads(dump).to_directory(tmp_path / "d")) / "state.txt").exists()


def test_a_key_pickles_as_its_token_and_finds_the_live_one() -> None:
    checkpoint = Checkpoint(path="lockedmem://b/c", storage_options=OPTIONS)
    key = checkpoint.storage_key
    assert (
        isinstance(key, StorageKey)
        and key.options() == OPTIONS
        and repr(key) == "StorageKey(names=['client_kwargs', 'secret'])"
    )
    assert pickle.loads(pickle.dumps(key)) is key and copy.deepcopy(key) is key
    assert restored_key("0" * 32, ("secret",)).options() is None
    assert (
        Checkpoint(path="lockedmem://b/c").storage_key is None
        and Checkpoint(path="x", storage_options={}).storage_key is None
    )
    assert dataclasses.replace(checkpoint, step=3).storage_key is key


def test_local_checkpoints_need_no_options(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "f").write_text("x")
    dump = pickle.dumps(Checkpoint(path=str(tmp_path / "ck"), storage_options=OPTIONS))
    gc.collect()
    orphan = pickle.loads(dump)
    assert orphan.to_directory() == str(tmp_path / "ck")
    assert (Path(orphan.to_directory(tmp_path / "copy")) / "f").read_text() == "x"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f'["{SECRET}"]', "SRC must be a JSON object (got a JSON list)"),
        (f'{{"secret": "{SECRET}"', "SRC is not valid JSON"),
        ("@/no/such/file", "SRC: cannot read /no/such/file"),
    ],
    ids=[
        "a-list",
        "not-json",
        "no-file",
    ],  # fixed ids: the secret is random, and xdist's workers must collect the same tests
)
def test_options_text_errors_never_quote_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        options_from_text(text, "SRC")
    assert SECRET not in str(info.value)
