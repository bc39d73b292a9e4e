"""A rank is named after what it runs (``ps``, ``htop``, ``pgrep -f train.py``, psutil), warm
(forked from the template, whose command line it would otherwise show) and cold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spark_torch import Distributor

from .conftest import SCRIPTS


def who_am_i() -> dict[str, Any]:
    import psutil

    me = psutil.Process()
    return {"cmdline": me.cmdline(), "name": me.name()}


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_script_rank_shows_the_script_and_its_arguments(warm: bool, tmp_path: Path, no_leftovers: None) -> None:
    script = SCRIPTS / "show_title.py"
    env = {"TITLE_DIR": str(tmp_path)}
    Distributor(num_processes=2, warm_start=warm, env=env, log_ranks=[]).run(str(script), "--lr", "0.1")
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"title-{rank}.json").read_text())
        assert seen["cmdline"] == ["spark-torch", "rank", f"{rank}:", "show_title.py", "--lr", "0.1"]
        assert seen["name"] == "show_title.py"  # pgrep show_title.py (the 15-byte comm)


def test_a_warm_title_is_cut_to_the_templates_command_line(tmp_path: Path, no_leftovers: None) -> None:
    """A warm rank has the room of the template's command line: a longer title is cut, never
    written into the environment block after it (the node's marker lives there)."""
    env = {"TITLE_DIR": str(tmp_path)}
    long = ["--" + "x" * 40 + str(i) for i in range(10)]
    Distributor(num_processes=1, warm_start=True, env=env, log_ranks=[]).run(str(SCRIPTS / "show_title.py"), *long)
    shown = " ".join(json.loads((tmp_path / "title-0.json").read_text())["cmdline"])
    assert shown.startswith("spark-torch rank 0: show_title.py --" + "x" * 40 + "0") and shown in " ".join(
        ["spark-torch rank 0: show_title.py", *long]
    )


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_function_rank_shows_the_functions_name(warm: bool, no_leftovers: None) -> None:
    seen = Distributor(num_processes=1, warm_start=warm, log_ranks=[]).run(who_am_i)
    assert seen == {"cmdline": ["spark-torch", "rank", "0:", "who_am_i()"], "name": "who_am_i"}


def test_a_replica_groups_rank_names_its_group() -> None:
    """Every group has a rank 0: the title says which group's (tests/test_replica_groups.py sees it in a run)."""
    from spark_torch.rank.title import rank_title

    assert rank_title(0, "train.py --lr 0.1", "1") == "spark-torch group 1 rank 0: train.py --lr 0.1"
    assert rank_title(0, "train()") == "spark-torch rank 0: train()"


def test_a_distributed_rank_is_named_too(spark_session: Any, no_leftovers: None) -> None:
    seen = Distributor(num_processes=2, local_mode=False, spark=spark_session, log_ranks=[]).run(who_am_i)
    assert seen == {"cmdline": ["spark-torch", "rank", "0:", "who_am_i()"], "name": "who_am_i"}
