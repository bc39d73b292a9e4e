"""The few Spark calls that differ between PySpark 3.5 and 4.x, and between classic and Connect.

- Collecting a DataFrame as Arrow: ``DataFrame.toArrow()`` is 4.0+; 3.5 has the private
  (but long-standing) ``_collect_as_arrow()`` (classic) and ``_to_table()`` (Connect).
- Cancelling one run's job: job tags (``addTag``/``interruptTag``) are Connect-only in 3.5, so
  classic sessions use a job group with ``interruptOnCancel`` (3.5 and 4.x alike), which also
  makes Spark interrupt the task threads and kill the Python workers (and the ranks with them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from spark_torch.driver.spark.cluster import is_connect_session
from spark_torch.errors import ConfigurationError

__all__ = ["collect_arrow", "tagged_job", "cancel_tagged_job", "check_pyspark", "SUPPORTED_PYSPARK"]

#: what distributed mode supports: ``mapInArrow(..., barrier=True)`` is new in 3.5
SUPPORTED_PYSPARK = "3.5 or 4.x"


def check_pyspark(version: str | None = None) -> None:
    """Raise :class:`~spark_torch.ConfigurationError` naming the version when this PySpark
    cannot run the barrier stage (before anything starts)."""
    if version is None:
        try:
            import pyspark
        except ImportError:
            return  # starting a session says what to install
        version = str(pyspark.__version__)
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return  # a development build: let it try
    if (major, minor) < (3, 5) or major >= 5:
        raise ConfigurationError(
            f"distributed mode needs PySpark {SUPPORTED_PYSPARK} (its barrier stage is mapInArrow(..., "
            f"barrier=True), new in 3.5); this driver has PySpark {version}. Upgrade pyspark (on "
            "Databricks: Runtime 14.3 LTS or newer), or use local_mode=True, which needs no Spark"
        )


def collect_arrow(df: Any) -> Any:
    """``df`` collected to the driver as one ``pyarrow.Table``."""
    if hasattr(df, "toArrow"):
        return df.toArrow()
    import pyarrow as pa

    if hasattr(df, "_to_table"):  # Spark Connect 3.5
        table, _schema = df._to_table()
        return table
    batches = df._collect_as_arrow()  # classic 3.5
    if batches:
        return pa.Table.from_batches(batches)
    return pa.Table.from_batches([], schema=_arrow_schema(df))


def _arrow_schema(df: Any) -> Any:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(df.schema)


@contextmanager
def tagged_job(spark: Any, tag: str) -> Iterator[None]:
    """Jobs started by this thread inside the block can be cancelled with :func:`cancel_tagged_job`."""
    if is_connect_session(spark):
        spark.addTag(tag)
        try:
            yield
        finally:
            spark.removeTag(tag)
        return
    sc = spark.sparkContext
    sc.setJobGroup(tag, "spark_torch run", interruptOnCancel=True)
    try:
        yield
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
        sc.setLocalProperty("spark.job.interruptOnCancel", None)


def cancel_tagged_job(spark: Any, tag: str) -> None:
    """Cancel the jobs of :func:`tagged_job` ``tag`` (interrupting their tasks)."""
    if is_connect_session(spark):
        spark.interruptTag(tag)
    else:
        spark.sparkContext.cancelJobGroup(tag)
