"""The ``spark-torch`` command: ``run`` a training script, ``doctor`` a cluster, list past ``runs``.

Command-line text becomes the same :class:`~spark_torch.Distributor` call the Python API
makes; nothing here launches processes by itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from spark_torch.base import envnames
from spark_torch.cli.parser import build_parser

__all__ = ["main", "build_parser"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _given_storage_options(flag: str | None) -> dict[str, Any] | None:
    """``--storage-options``, else ``$SPARK_TORCH_STORAGE_OPTIONS``, else None. The variable is
    removed from this process's environment once read (given the flag too): nothing this
    command starts (the Spark JVM, the ranks, a warm-start template) inherits it."""
    from_env = os.environ.pop(envnames.STORAGE_OPTIONS, None)
    if flag is not None:
        return _storage_options(flag, "--storage-options")
    return None if from_env is None else _storage_options(from_env, envnames.STORAGE_OPTIONS)


def _storage_options(text: str, source: str) -> dict[str, Any]:
    """A JSON object, or ``@FILE`` naming a file that holds one (never quoted in an error)."""
    from spark_torch.reporting.storage_keys import options_from_text

    return options_from_text(text, source)


def _log_ranks(text: str) -> Any:
    if text in ("all", "none"):
        return text
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--log-ranks takes all, none, or rank numbers like 0,1; got {text!r}") from None


def _session(args: argparse.Namespace, needed: bool) -> Any | None:
    if not needed and args.master is None and not args.conf:
        return None
    from spark_torch.driver.spark.session import get_or_create_session

    spark = get_or_create_session(master=args.master, conf=dict(args.conf))
    if not os.environ.get(envnames.CLI_VERBOSE):
        try:
            spark.sparkContext.setLogLevel("ERROR")
        except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext here
            pass
    return spark


def _paragraph(message: str) -> str:
    head, _, rest = message.partition("\n")
    return "spark-torch: error: " + head + (("\n" + rest) if rest else "")


def _interrupted(interrupt: KeyboardInterrupt) -> str:
    """What Ctrl-C prints: that every rank was stopped, then where each was (the notes the run
    added to the interrupt, as the Python API shows them), once."""
    notes = [note for note in getattr(interrupt, "__notes__", []) if isinstance(note, str)]
    return "\n".join(["spark-torch: interrupted; every rank was stopped", *dict.fromkeys(notes)])


def _run(args: argparse.Namespace) -> int:
    from spark_torch.driver.api.distributor import Distributor
    from spark_torch.errors import ConfigurationError, DistributedRunError, LaunchError, PicklingError

    try:
        local_mode = args.local_mode
        if local_mode is None:
            local_mode = args.master is None
            if not local_mode:  # a master says where to run: never silently ignored
                print(
                    f"spark-torch: --master {args.master}: running distributed (pass --local to run every "
                    "rank on this machine)",
                    file=sys.stderr,
                )
        score, _, order = (args.checkpoint_score or "").partition(":")
        storage_options = _given_storage_options(args.storage_options)
        spark = _session(args, needed=not local_mode)
        distributor = Distributor(
            num_processes=args.num_processes,
            local_mode=local_mode,
            use_gpu=args.use_gpu,
            spark=spark,
            env=dict(args.env),
            timeout=args.timeout,
            max_restarts=args.max_restarts,
            min_processes=args.min_processes,
            elastic_grow=args.elastic_grow,
            ranks_per_task=args.ranks_per_task,
            storage_path=args.storage_path,
            run_id=args.run_id,
            keep_checkpoints=args.keep_checkpoints,
            checkpoint_score_attribute=score or None,
            checkpoint_score_order=order or "max",
            storage_options=storage_options,
            log_ranks=_log_ranks(args.log_ranks),
            log_dir=args.log_dir,
            mlflow=args.mlflow,
            progress=args.progress,
            stall_timeout=args.stall_timeout,
            stall_action=args.stall_action,
        )
        distributor.run(args.script, *args.script_args)
        if distributor.last_run is not None and distributor.last_run.rows:
            last = distributor.last_run
            print(
                f"spark-torch: run {last.run_id}: {len(last.rows)} report(s), latest checkpoint "
                f"{last.checkpoint.path if last.checkpoint else '(none)'}",
                file=sys.stderr,
            )
    except KeyboardInterrupt as interrupt:
        print(_interrupted(interrupt), file=sys.stderr)
        return EXIT_INTERRUPTED
    except (
        ConfigurationError,
        PicklingError,
        FileNotFoundError,
        IsADirectoryError,
        PermissionError,
        TypeError,
        ValueError,
    ) as exc:
        print(_paragraph(str(exc)), file=sys.stderr)
        return EXIT_USAGE
    except DistributedRunError as exc:
        print(_paragraph(str(exc)), file=sys.stderr)
        root = exc.failures[0] if exc.failures else None
        return root.exit_code if root is not None and root.exit_code else 1
    except (LaunchError, ImportError) as exc:
        print(_paragraph(str(exc)), file=sys.stderr)
        return 1
    return 0


def _runs(args: argparse.Namespace) -> int:
    """``spark-torch runs [STORAGE]`` and ``spark-torch runs show RUN_ID [--storage STORAGE]``."""
    from spark_torch.driver.api.past_runs import list_runs, read_summary, run_details, runs_table, summary_json
    from spark_torch.driver.result import RunResult
    from spark_torch.reporting.storage import DEFAULT_STORAGE, RunStorage

    words = list(args.words)
    show = words[:1] == ["show"]
    if (show and len(words) != 2) or (not show and len(words) > 1):
        print(
            "spark-torch runs: error: give one STORAGE to list, or show RUN_ID (a storage named show: ./show)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not show and words and args.storage is not None:
        print(
            "spark-torch runs: error: give the storage once: runs STORAGE, or runs --storage STORAGE", file=sys.stderr
        )
        return EXIT_USAGE
    score, _, order = (args.checkpoint_score or "").partition(":")
    try:
        options = _given_storage_options(args.storage_options)
        if order not in ("", "min", "max"):
            raise ValueError(f"--checkpoint-score {args.checkpoint_score}: write METRIC, METRIC:max or METRIC:min")
        if not show:
            base = words[0] if words else (args.storage or DEFAULT_STORAGE)
            summaries = list_runs(
                base,
                storage_options=options,
                checkpoint_score_attribute=score or None,
                checkpoint_score_order=order or None,
            )
            if args.json:
                print(json.dumps([summary_json(s) for s in summaries], indent=2))
            elif summaries:
                print(runs_table(summaries))
            else:
                print(f"spark-torch: no runs in {base}", file=sys.stderr)
            return 0
        base = args.storage or DEFAULT_STORAGE
        result = RunResult.from_path(
            base,
            words[1],
            storage_options=options,
            checkpoint_score_attribute=score or None,
            checkpoint_score_order=order or None,
        )
        # a replica-group run is its groups' runs (RUN_ID-g0, ...): each group's details, in order
        parts = result.replica_groups or [result]
        summaries = [
            read_summary(RunStorage(base, part.run_id, options), score or None, order or None) for part in parts
        ]
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError) as exc:
        print(_paragraph(str(exc)), file=sys.stderr)
        return EXIT_USAGE
    shown: list[Any] = []
    for part, summary in zip(parts, summaries, strict=True):
        if args.json:
            data = summary_json(summary)
            data["checkpoints"] = [
                {"path": c.path, "step": c.step, "metrics": c.metrics} for c, _ in part.best_checkpoints
            ]
            data["history"] = part.history
            shown.append(data)
        else:
            head = f"replica group {parts.index(part)} of run {result.run_id}\n" if result.replica_groups else ""
            shown.append(head + run_details(summary, [c for c, _ in part.best_checkpoints]))
    if args.json:
        whole = {"run_id": result.run_id, "replica_groups": shown} if result.replica_groups else shown[0]
        print(json.dumps(whole, indent=2, default=str))
    else:
        print("\n\n".join(shown))
    return 0


def _stack_dumps_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints every thread's stack to stderr (for a run that seems stuck)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (ValueError, RuntimeError, OSError):  # e.g. stderr is not a real file
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``spark-torch`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    _stack_dumps_on_sigusr1()
    if args.command == "run":
        return _run(args)
    if args.command == "doctor":
        from spark_torch.cli.doctor import run_doctor
        from spark_torch.errors import LaunchError

        os.environ.pop(envnames.STORAGE_OPTIONS, None)  # doctor reads no storage: the JVM must not inherit it
        try:
            return run_doctor(_session(args, needed=True))
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except (LaunchError, ImportError) as exc:
            print(_paragraph(str(exc)), file=sys.stderr)
            return 1
    if args.command == "runs":
        return _runs(args)
    parser.print_help()
    print(textwrap.dedent("\nerror: choose a command: run, doctor or runs"), file=sys.stderr)
    return EXIT_USAGE
