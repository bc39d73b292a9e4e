"""``to_tensor``: imported by streaming.vision, never called by the benchmark."""

from typing import Any


def to_tensor(pic: Any) -> Any:
    """Stand-in: refuses, as the benchmark has no images."""
    raise NotImplementedError("the benchmark's torchvision stand-in has no image transforms")
