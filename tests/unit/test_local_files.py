"""The run's storage on a local filesystem never writes through another user's link
(``spark_torch/reporting/local_files.py``): a run folder, or an entry in it, that is a link,
a hard link, a named pipe or another user's is refused with a ConfigurationError naming the
path and what to do, and nothing is written through it; what the run makes is private whatever
the umask; a team folder (set-group-ID) accepts its group's members and no one else.

"Another user" is uid 65534 (nobody) for real: a forked child that drops to it makes what it
plants, in a folder every user may write to (``/tmp``-like, or ``~/spark_torch_runs`` made
under ``umask 000``). An outsider of the team folder's group is uid 1 (daemon).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from spark_torch.errors import ConfigurationError
from spark_torch.reporting.ranking import CheckpointInfo
from spark_torch.reporting.storage import ATTEMPTS, METRICS, RUN_MARKER, RunStorage, run_ids
from tests.other_user import NOBODY, as_user

DAEMON = 1  # not a member of nogroup
RUN = "planted-run"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root (setuid in a child)")


def _storage(base: Path) -> RunStorage:
    return RunStorage(str(base), RUN, {})


def _plant_run_folder(base: Path, victim: Path) -> None:
    """As nobody: RUN/ first, with metrics.jsonl a link to the victim's file and an attempts.jsonl of its own (0666)."""

    def plant() -> None:
        run = base / RUN
        run.mkdir(0o777)
        (run / METRICS).symlink_to(victim)
        (run / ATTEMPTS).touch(0o666)

    as_user(NOBODY, NOBODY, plant)


def test_another_users_run_folder_is_refused(open_base: Path, victim: Path) -> None:
    """The issue's attack: nothing is appended to the victim's file nor to the other user's, and
    the error names the run folder, its owner and what to do."""
    _plant_run_folder(open_base, victim)
    storage = _storage(open_base)
    started = time.monotonic()
    for write in (
        lambda: storage.create("token"),
        lambda: storage.append_metrics({"step": 1}),
        lambda: storage.record_attempt(0, 1, 1),
        lambda: storage.complete(1, 0, [0]),
    ):
        with pytest.raises(ConfigurationError) as caught:
            write()
        message = str(caught.value)
        assert f"{open_base / RUN} belongs to another user (uid {NOBODY})" in message, message
        assert "storage_path=" in message and "run_id=" in message and "chmod 2770" in message, message
    assert time.monotonic() - started < 1.0
    assert victim.read_text() == "mine\n"
    assert (open_base / RUN / ATTEMPTS).stat().st_size == 0
    assert sorted(os.listdir(open_base / RUN)) == [ATTEMPTS, METRICS]  # no marker, no checkpoint folder
    with pytest.raises(ConfigurationError, match="belongs to another user"):
        storage.visible("token")  # a node's check of the driver's marker says why too
    with pytest.raises(ConfigurationError, match="belongs to another user"):
        storage.history()
    assert run_ids(str(open_base), {}) == []  # not listed (nor pruned)


def test_a_link_as_the_run_folder_is_refused(open_base: Path, tmp_path: Path) -> None:
    """RUN -> a folder of this user's: not followed (nothing made in it)."""
    target = tmp_path / "mine"
    target.mkdir()
    as_user(NOBODY, NOBODY, lambda: (open_base / RUN).symlink_to(target))
    with pytest.raises(ConfigurationError, match=f"{open_base / RUN} is a symbolic link"):
        _storage(open_base).create("token")
    with pytest.raises(ConfigurationError, match="is a symbolic link"):
        _storage(open_base).upload(str(tmp_path), 1)
    assert list(target.iterdir()) == []


def test_a_link_in_the_run_folder_is_refused(open_base: Path, victim: Path, tmp_path: Path) -> None:
    """Entries of this user's own run folder: a link, a hard link, a named pipe (which must not
    block), a checkpoint folder that is a link; each refused with its path, nothing written."""
    storage = _storage(open_base)
    storage.create("token")
    run = open_base / RUN
    (run / METRICS).symlink_to(victim)
    with pytest.raises(ConfigurationError, match=f"{run / METRICS} is a symbolic link"):
        storage.append_metrics({"step": 1})
    (run / METRICS).unlink()
    os.link(victim, run / METRICS)
    with pytest.raises(ConfigurationError, match="has 2 names"):
        storage.append_metrics({"step": 1})
    (run / METRICS).unlink()
    os.mkfifo(run / METRICS)
    with pytest.raises(ConfigurationError, match="named pipe"):
        storage.append_metrics({"step": 1})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "checkpoint_000001").symlink_to(elsewhere)
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "w.bin").write_bytes(b"w")
    with pytest.raises(ConfigurationError, match="checkpoint_000001 is a symbolic link"):
        storage.upload(str(source), 1)
    with pytest.raises(ConfigurationError, match="checkpoint_000001 is a symbolic link"):
        storage.complete(1, 0, [0])
    with pytest.raises(
        ConfigurationError, match="checkpoint_000001 is a symbolic link"
    ):  # a node, before a rank resumes from it
        storage.download(CheckpointInfo(step=1, url=storage.checkpoint_url(1)), str(tmp_path / "unused"))
    (run / "checkpoint_000002").mkdir()
    (run / "checkpoint_000002" / "w.bin").symlink_to(victim)
    with pytest.raises(ConfigurationError, match="w.bin is a symbolic link"):
        storage.upload(str(source), 2)
    assert victim.read_text() == "mine\n" and list(elsewhere.iterdir()) == []
    storage.remove_checkpoint(1)  # the link goes, not what it points at
    assert not os.path.lexists(run / "checkpoint_000001") and elsewhere.is_dir()


def test_under_umask_000_everything_made_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default storage ~/spark_torch_runs (and a missing folder above a storage path) is
    made 0700, a run's folders 0700 and its files 0600, whatever the umask."""
    from spark_torch.reporting.storage import DEFAULT_STORAGE

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    source = tmp_path / "ckpt"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "w.bin").write_bytes(b"w" * 100)
    mask = os.umask(0)
    try:
        storage = RunStorage(DEFAULT_STORAGE, RUN, {})
        storage.create("token")
        storage.upload(str(source), 1)
        storage.complete(1, 0, [0], {"loss": 1.0})
        storage.append_metrics({"step": 1})
    finally:
        os.umask(mask)
    home = tmp_path / "home"
    modes = {str(p.relative_to(home)): oct(stat.S_IMODE(p.stat().st_mode)) for p in [home, *home.rglob("*")]}
    wanted = {name: oct(0o700 if (home / name).is_dir() else 0o600) for name in modes}
    assert modes == wanted
    assert (home / "spark_torch_runs" / RUN / "checkpoint_000001" / "sub" / "w.bin").read_bytes() == b"w" * 100
    assert [c.step for c in storage.checkpoints()[0]] == [1] and storage.history()[0]["step"] == 1


@pytest.fixture
def team_base(open_base: Path) -> Path:
    """A team's storage folder: group nogroup (nobody's), set-group-ID, 2770."""
    team = open_base / "team"
    team.mkdir()
    os.chown(team, 0, NOBODY)
    team.chmod(0o2770)
    return team


def test_a_team_folder_accepts_its_members_only(team_base: Path, victim: Path) -> None:
    """A run folder a teammate (a member of the folder's group) made is used, its 0660 files
    appended to; a teammate's link is still refused."""

    def teammate() -> None:
        os.umask(0o007)
        run = team_base / RUN
        run.mkdir(0o2770)
        (run / METRICS).write_text('{"step": 1}\n')
        (run / "link.jsonl").symlink_to(victim)

    as_user(NOBODY, NOBODY, teammate)
    storage = _storage(team_base)
    storage.create("token")
    storage.append_metrics({"step": 2})
    assert [row["step"] for row in storage.history()] == [1, 2]
    run = team_base / RUN
    assert stat.S_IMODE((run / RUN_MARKER).stat().st_mode) == 0o660 and (run / RUN_MARKER).stat().st_gid == NOBODY
    assert run_ids(str(team_base), {}) == [RUN]
    with pytest.raises(ConfigurationError, match="link.jsonl is a symbolic link"):
        storage.append_log("link.jsonl", {"x": 1})
    assert victim.read_text() == "mine\n"


def test_a_team_folder_refuses_other_users(team_base: Path) -> None:
    """An outsider who could write to the team folder (2777: a mistake) makes RUN first: its
    group is the team's (set-group-ID), but its owner is no member: refused. A teammate's entry
    every user may write to is refused too."""
    team_base.chmod(0o2777)
    as_user(DAEMON, DAEMON, lambda: (team_base / RUN).mkdir(0o2770))
    assert (team_base / RUN).stat().st_gid == NOBODY  # inherited: the group alone proves nothing
    with pytest.raises(ConfigurationError, match=f"uid {DAEMON}\\) who is not a member of the team folder's group"):
        _storage(team_base).create("token")
    assert run_ids(str(team_base), {}) == []
    other = "open-entry"
    as_user(NOBODY, NOBODY, lambda: (team_base / other).mkdir(0o2777))
    with pytest.raises(ConfigurationError, match="every user may write to it"):
        RunStorage(str(team_base), other, {}).create("token")


def test_prune_skips_refused_folders(open_base: Path, victim: Path) -> None:
    """The default storage's retention never reads or removes another user's folder or a link."""
    from spark_torch.reporting.run_log import prune_unreported

    _plant_run_folder(open_base, victim)
    as_user(NOBODY, NOBODY, lambda: (open_base / RUN / RUN_MARKER).touch(0o666))
    assert prune_unreported(str(open_base), {}, keep=0) == []
    assert (open_base / RUN).is_dir() and victim.read_text() == "mine\n"
