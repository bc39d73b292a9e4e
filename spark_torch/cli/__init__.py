"""The ``spark-torch`` command: run, doctor, runs."""
