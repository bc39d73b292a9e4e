"""Everything that talks to Spark: the session, the cluster's conf and slots, shipping the package, PySpark version shims, DataFrames, Java and executor checks."""
