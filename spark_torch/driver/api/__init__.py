"""The public API of the driver: Distributor, PySpark's TorchDistributor and DeepspeedTorchDistributor constructors, past runs."""
