"""Stand-in for ``torchvision.transforms``: only ``functional``."""
