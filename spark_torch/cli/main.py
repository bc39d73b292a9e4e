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
from spark_torch.version import __version__

__all__ = ["main", "build_parser"]

EXAMPLES = """\
examples:
  spark-torch run --num-processes 2 train.py --lr 0.01 --epochs 3
  spark-torch run --distributed --master 'local-cluster[2,1,1024]' -n 2 train.py --lr 0.01
  spark-torch run --distributed --master spark://host:7077 --conf spark.task.cpus=4 \\
      --env NCCL_SOCKET_IFNAME=eth0 --timeout 3600 -n 8 train.py
  spark-torch doctor --master spark://host:7077
  spark-torch runs ~/spark_torch_runs
  spark-torch runs show RUN_ID --storage ~/spark_torch_runs
"""

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used to render --help in the docs)."""
    parser = argparse.ArgumentParser(
        prog="spark-torch",
        description="Run PyTorch distributed training on Apache Spark.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"spark-torch {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run a training script on N ranks (like torchrun)",
        description="Run SCRIPT on every rank with torchrun's environment. Arguments after "
        "SCRIPT are passed to it untouched.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("-n", "--num-processes", type=int, default=1, help="total ranks (default 1)")
    where = run.add_mutually_exclusive_group()
    where.add_argument(
        "--local",
        dest="local_mode",
        action="store_const",
        const=True,
        default=None,
        help="all ranks on this machine (the default without --master)",
    )
    where.add_argument(
        "--distributed",
        dest="local_mode",
        action="store_const",
        const=False,
        help="one Spark barrier task per node on the executors (the default with --master)",
    )
    device = run.add_mutually_exclusive_group()
    device.add_argument(
        "--gpu",
        dest="use_gpu",
        action="store_const",
        const=True,
        default=None,
        help="use the GPUs Spark assigns (default: auto)",
    )
    device.add_argument("--cpu", dest="use_gpu", action="store_const", const=False, help="never use GPUs")
    _spark_options(run)
    run.add_argument(
        "--env",
        action="append",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for every rank (repeatable)",
    )
    run.add_argument("--timeout", type=float, default=None, metavar="S", help="bound on the whole run, seconds")
    run.add_argument(
        "--max-restarts", type=int, default=0, metavar="N", help="restart the gang up to N times (-1: no limit)"
    )
    run.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        metavar="S",
        help="a run whose ranks made no progress for S seconds is stalled: log every rank's stack (default 120; 0: off)",
    )
    run.add_argument(
        "--stall-action",
        choices=["warn", "fail"],
        default=None,
        help="on a stall: warn (the default) or fail (stop the run with RunStalledError)",
    )
    run.add_argument(
        "--min-processes",
        type=int,
        default=None,
        metavar="M",
        help="distributed: go on with at least M ranks when nodes are missing or lost (default: -n)",
    )
    run.add_argument(
        "--grow",
        dest="elastic_grow",
        action="store_true",
        help="with --min-processes: restart larger at the next checkpoint once slots are free again",
    )
    run.add_argument(
        "--ranks-per-task",
        type=int,
        default=None,
        metavar="N",
        help="distributed CPU mode: ranks per Spark task (node); default 1",
    )
    run.add_argument(
        "--storage-path",
        default=None,
        metavar="DIR_OR_URL",
        help="where spark_torch.report() keeps checkpoints and metrics (default ~/spark_torch_runs)",
    )
    run.add_argument(
        "--run-id",
        default=None,
        metavar="ID",
        help="the run's name in the storage; an existing one resumes from its latest checkpoint",
    )
    run.add_argument(
        "--keep-checkpoints",
        type=int,
        default=None,
        metavar="N",
        help="keep only N checkpoints: the newest, or the best by --checkpoint-score (default: all)",
    )
    run.add_argument(
        "--checkpoint-score",
        default=None,
        metavar="METRIC[:min]",
        help="rank checkpoints by this reported metric (higher is better; METRIC:min for lower)",
    )
    run.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON|@FILE",
        help="fsspec options of the storage as a JSON object, e.g. '{\"anon\": false}', or @FILE: a "
        f"file holding one (default: ${envnames.STORAGE_OPTIONS}, either form). Credentials belong in the "
        "file or the variable: a command line is visible to every user of this machine (ps)",
    )
    run.add_argument(
        "--log-ranks",
        default="all",
        metavar="all|none|0,1,...",
        help="whose output to print (default all; the others still go to --log-dir)",
    )
    run.add_argument("--log-dir", default=None, metavar="DIR", help="also write each rank's output to DIR/rank-N.log")
    run.add_argument(
        "--mlflow",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log the reported metrics to MLflow (default: when an MLflow run is active)",
    )
    run.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show the live status line (default: in a terminal)",
    )
    run.add_argument("script", metavar="SCRIPT", help="path of the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments of the script")

    doctor = commands.add_parser(
        "doctor",
        help="check that a cluster can run spark_torch",
        description="Check versions on the driver and executors, slots, GPUs, TLS, and a 2-rank gloo all_reduce.",
    )
    _spark_options(doctor)

    runs = commands.add_parser(
        "runs",
        help="list the runs kept in a storage, or show one",
        description="runs [STORAGE]: one line per run kept in STORAGE (default ~/spark_torch_runs), newest "
        "first: its id, start, duration, outcome (succeeded, failed with the error's first line, stopped by "
        "timeout, a stall or Ctrl-C), entry point (function, or script and arguments), attempts, world size, "
        "steps, last metrics and best checkpoint (by the run's checkpoint score, else the latest); runs that "
        "reported nothing too. runs show RUN_ID [--storage STORAGE]: one run in full (every run() call with "
        "its attempts' ends and reasons, every kept checkpoint, in that order).",
    )
    runs.add_argument(
        "words",
        nargs="*",
        metavar="STORAGE | show RUN_ID",
        help="a storage directory or URL to list; or show and a run's id",
    )
    runs.add_argument(
        "--storage", default=None, metavar="DIR_OR_URL", help="the storage of runs show (default ~/spark_torch_runs)"
    )
    runs.add_argument(
        "--checkpoint-score",
        default=None,
        metavar="METRIC[:min]",
        help="the best checkpoint is the one with the highest METRIC (METRIC:min: lowest); default: the "
        "score each run was configured with (checkpoint_score_attribute), else the latest",
    )
    runs.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON|@FILE",
        help=f"fsspec options of the storage, as for run (default: ${envnames.STORAGE_OPTIONS})",
    )
    runs.add_argument("--json", action="store_true", help="print JSON (a list of runs, or one run)")
    return parser


def _spark_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master",
        default=None,
        metavar="URL",
        help="Spark master (default: the spark-submit/active session, else local[*])",
    )
    parser.add_argument(
        "--conf",
        action="append",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="Spark configuration (repeatable)",
    )


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
