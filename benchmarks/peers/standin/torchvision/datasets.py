"""``VisionDataset``: the base class streaming.vision subclasses (never used by the benchmark)."""

from typing import Any


class VisionDataset:
    """Stand-in: keeps the arguments, as torchvision's does."""

    def __init__(
        self, root: Any = None, transforms: Any = None, transform: Any = None, target_transform: Any = None
    ) -> None:
        self.root, self.transforms, self.transform, self.target_transform = (
            root,
            transforms,
            transform,
            target_transform,
        )
