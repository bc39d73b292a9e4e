"""What the ``spark-torch`` command line accepts: its commands, options and their help.

The commands themselves (what ``run``, ``doctor`` and ``runs`` do with the parsed options) are in
:mod:`spark_torch.cli.main`; this module only parses.

May import: spark_torch.base, spark_torch.version.
"""

from __future__ import annotations

import argparse

from spark_torch.base import envnames
from spark_torch.version import __version__

__all__ = ["build_parser", "EXAMPLES"]

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


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


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
        help="a run whose ranks made no progress for S seconds is stalled: log every rank's stack "
        "(default 120; 0: off)",
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
