"""Raise a ValueError on rank 1."""

import os

if os.environ["RANK"] == "1":
    raise ValueError("script failed on purpose")
