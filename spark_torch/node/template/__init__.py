"""Warm rank starts: the template server, its client, the forked child, and their protocol.

May import: what the node layer may import (the channel, reporting and the shared modules),
never the driver; the forked child starts a rank by module name (``layers`` and
``ranks-by-name`` in pyproject.toml).
"""
