"""The node <-> rank file contract (spark_torch.shared.workdir_files): every path is under the node's
scratch directory and distinct, storage.json round-trips through its schema, and a missing or
garbled storage.json is a clear error that never quotes the file (it holds credentials)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from spark_torch.errors import LaunchError
from spark_torch.shared import rank_files
from spark_torch.shared.spec import StorageSpec
from spark_torch.shared.workdir_files import (
    StorageFile,
    WorkdirFiles,
    child_stack_path,
    child_stack_pattern,
    make_private,
    native_dump_path,
    open_private,
    trace_path,
    trace_request_path,
)


def _every_path(files: WorkdirFiles, rank: int) -> dict[str, str]:
    stack = files.stack(rank)
    return {
        "payload": files.payload(),
        "storage": files.storage(),
        "files_dir": files.files_dir(),
        "file": files.file("conf.yaml"),
        "data": files.data(),
        "checkpoint": files.checkpoint(),
        "result": files.result(rank),
        "error": files.error(rank),
        "elastic_error": files.elastic_error(rank),
        "stack": stack,
        "trace": trace_path(stack),
        "trace_request": trace_request_path(stack),
        "native": native_dump_path(stack),
        "child": child_stack_path(stack, 4242),
        "streamed_result": files.streamed_result(),
        "result_token": files.result_token(),
    }


def test_every_path_is_under_the_workdir_and_distinct(tmp_path: Path) -> None:
    files = WorkdirFiles(str(tmp_path))
    paths = {**_every_path(files, 0), **{f"{k}-3": v for k, v in _every_path(files, 3).items()}}
    for name, path in paths.items():
        assert os.path.commonpath([path, str(tmp_path)]) == str(tmp_path), name
    # the node-wide files are the same for every rank; the per-rank ones differ
    per_rank = {"result", "error", "elastic_error", "stack", "trace", "trace_request", "native", "child"}
    assert len({paths[k] for k in per_rank} | {paths[f"{k}-3"] for k in per_rank}) == 2 * len(per_rank)
    assert len(set(_every_path(files, 0).values())) == len(_every_path(files, 0))


def test_the_names_on_disk_are_unchanged(tmp_path: Path) -> None:
    files = WorkdirFiles(str(tmp_path))
    names = {k: os.path.relpath(v, tmp_path) for k, v in _every_path(files, 2).items()}
    assert names == {
        "payload": "payload.pkl",
        "storage": "storage.json",
        "files_dir": "files",
        "file": os.path.join("files", "conf.yaml"),
        "data": "data",
        "checkpoint": "checkpoint",
        "result": "rank-2.result",
        "error": "rank-2.error.json",
        "streamed_result": "rank-0.streamed-result",
        "result_token": ".spark_torch_result_dir",
        "elastic_error": "rank-2.torchelastic-error.json",
        "stack": "stack-2.json",
        "trace": "stack-2.json.trace",
        "trace_request": "stack-2.json.trace-request",
        "native": "stack-2.json.native",
        "child": "stack-2.json.child-4242",
    }


def test_a_file_name_never_leaves_the_files_folder(tmp_path: Path) -> None:
    files = WorkdirFiles(str(tmp_path))
    assert files.file("../../etc/passwd") == os.path.join(files.files_dir(), "passwd")


def test_child_stack_pattern_matches_child_stack_files_only(tmp_path: Path) -> None:
    import glob

    stack = WorkdirFiles(str(tmp_path / "odd[dir]")).stack(0)
    os.makedirs(os.path.dirname(stack))
    for path in (child_stack_path(stack, 7), child_stack_path(stack, 8), trace_path(stack), stack):
        Path(path).write_text("x")
    assert sorted(glob.glob(child_stack_pattern(stack))) == [child_stack_path(stack, 7), child_stack_path(stack, 8)]


def test_rank_files_write_where_the_contract_says(tmp_path: Path) -> None:
    files = WorkdirFiles(str(tmp_path))
    rank_files.write_result(str(tmp_path), 1, {"loss": 0.5})
    rank_files.write_error(str(tmp_path), 2, ValueError("bad"))
    assert os.path.isfile(files.result(1)) and os.path.isfile(files.error(2))
    error = rank_files.read_rank_error(str(tmp_path), 2)
    assert error is not None and error.exc_type == "ValueError" and error.exc_message == "bad" and error.pickled
    assert rank_files.read_rank_error(str(tmp_path), 1) is None  # rank 1 wrote no error
    # a rank that wrote none of its own: what torch's @record wrote, read the same way
    extra = {"py_callstack": "Traceback ...\nValueError: boom\n"}
    Path(files.elastic_error(1)).write_text(
        json.dumps({"message": {"message": "ValueError: boom", "extraInfo": extra}})
    )
    recorded = rank_files.read_rank_error(str(tmp_path), 1)
    assert recorded == rank_files.RankError(exc_type="ValueError", exc_message="boom", traceback=extra["py_callstack"])
    assert stat.S_IMODE(os.stat(files.error(2)).st_mode) == 0o600


def test_storage_file_round_trips_and_keeps_its_keys(tmp_path: Path) -> None:
    spec = StorageSpec(base="s3://bucket/runs", token="t0k", options={"key": "SECRET", "anon": False}, required=True)
    described = StorageFile.of(spec, "run-7")
    assert "SECRET" not in repr(described) and "t0k" not in repr(described)
    data = described.to_json()
    assert json.loads(data) == {
        "base": "s3://bucket/runs",
        "run_id": "run-7",
        "token": "t0k",
        "options": {"key": "SECRET", "anon": False},
    }
    back = StorageFile.from_json(data)
    assert back == described
    assert back.spec() == StorageSpec(base="s3://bucket/runs", token="t0k", options={"key": "SECRET", "anon": False})
    path = WorkdirFiles(str(tmp_path)).storage()
    rank_files.write_atomic(path, data)
    assert StorageFile.read(path) == described
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_storage_file_opens_the_same_storage_as_the_spec(tmp_path: Path) -> None:
    from spark_torch.reporting.storage import RunStorage

    spec = StorageSpec(base=str(tmp_path), token="abc")
    RunStorage(spec.base, "r1", spec.options).create("abc")
    described = StorageFile.from_json(StorageFile.of(spec, "r1").to_json())
    opened = RunStorage(described.spec().base, described.run_id, described.spec().options)
    assert opened.url == RunStorage(str(tmp_path), "r1", {}).url == os.path.join(str(tmp_path), "r1")
    assert opened.visible(described.token)


def test_a_missing_storage_file_is_a_clear_error(tmp_path: Path) -> None:
    path = str(tmp_path / "storage.json")
    with pytest.raises(
        LaunchError,
        match=r"cannot read .*storage\.json, the run's storage as the node runner described it: No such file",
    ):
        StorageFile.read(path)


@pytest.mark.parametrize(
    ("content", "fault"),
    [
        (b'{"base": "/x", "run_id": "r", "tok', "is not valid JSON"),
        (b"\xff\xfe not text", "is not valid JSON"),
        (b'["SECRET"]', "holds a list, not a JSON object"),
        (b'{"base": "/x", "run_id": "r"}', "lacks or garbles token"),
        (b'{"base": 5, "run_id": "r", "token": "t"}', "lacks or garbles base"),
        (b'{"base": "/x", "run_id": "r", "token": "t", "options": ["SECRET"]}', "lacks or garbles options"),
        (b'{"base": "", "run_id": "r", "token": "t"}', "base or run_id \\(empty\\)"),
    ],
)
def test_a_garbled_storage_file_is_a_clear_error_that_quotes_nothing(
    tmp_path: Path, content: bytes, fault: str
) -> None:
    path = tmp_path / "storage.json"
    path.write_bytes(content)
    with pytest.raises(LaunchError, match=fault) as caught:
        StorageFile.read(str(path))
    assert str(path) in str(caught.value) and "SECRET" not in str(caught.value)
    assert isinstance(caught.value, RuntimeError)


def test_options_may_be_absent() -> None:
    assert StorageFile.from_json('{"base": "/x", "run_id": "r", "token": "t"}').options == {}


@pytest.fixture
def umask_0() -> Iterator[None]:
    """The umask Spark executors often have: files are created as wide as their opener asks."""
    old = os.umask(0)
    yield
    os.umask(old)


@pytest.mark.parametrize("mode", ["w", "wb", "a", "ab", "x", "xb"])
def test_open_private_creates_0600_whatever_the_umask(mode: str, tmp_path: Path, umask_0: None) -> None:
    path = tmp_path / "f"
    with open_private(str(path), mode) as fh:
        fh.write(b"x" if "b" in mode else "x")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "x"


def test_open_private_appends_and_truncates_like_open(tmp_path: Path) -> None:
    path = str(tmp_path / "f")
    with open_private(path, "a") as fh:
        fh.write("ab")
    with open_private(path, "a") as fh:
        fh.write("cd")
    assert Path(path).read_text() == "abcd"
    with open_private(path, "w") as fh:
        fh.write("e")
    assert Path(path).read_text() == "e"
    with pytest.raises(FileExistsError):
        open_private(path, "x")


def test_open_private_names_the_modes_it_takes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"open_private takes the modes .*'w'.*, not 'r\+'"):
        open_private(str(tmp_path / "f"), "r+")
    assert not (tmp_path / "f").exists()


def test_make_private_narrows_a_downloaded_tree(tmp_path: Path, umask_0: None) -> None:
    root = tmp_path / "checkpoint"
    (root / "sub").mkdir(parents=True, mode=0o777)
    (root / "sub" / "w.pt").write_bytes(b"1")
    (root / "top.json").write_text("{}")
    os.chmod(root / "top.json", 0o666)
    outside = tmp_path / "outside"
    outside.write_text("")
    os.chmod(outside, 0o644)
    (root / "link").symlink_to(outside)
    make_private(str(root))
    modes = {
        p.relative_to(root).as_posix(): oct(stat.S_IMODE(p.lstat().st_mode))
        for p in [root, *root.rglob("*")]
        if not p.is_symlink()
    }
    assert modes == {".": "0o700", "sub": "0o700", "sub/w.pt": "0o600", "top.json": "0o600"}
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644  # a link is not followed
