"""A stand-in for torchvision in the Mosaic Streaming side venv only (benchmarks/peers/setup.sh).

`import streaming` imports streaming.vision, which imports ``torchvision.datasets.VisionDataset``
and ``torchvision.transforms.functional.to_tensor``; the benchmark uses neither. PyPI's torchvision
needs CUDA beside a CPU torch, so this package provides only those names.
"""
