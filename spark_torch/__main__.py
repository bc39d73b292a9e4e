"""``python -m spark_torch`` is the ``spark-torch`` command."""

from spark_torch.cli.main import main

raise SystemExit(main())
