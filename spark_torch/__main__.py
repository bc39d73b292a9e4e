"""``python -m spark_torch`` is the ``spark-torch`` command."""

from .cli import main

raise SystemExit(main())
