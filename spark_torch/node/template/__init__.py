"""Warm rank starts: the template server, its client, the forked child, and their protocol.

May import: the rest of spark_torch.node and what spark_torch.node may import; never
spark_torch.driver. The server imports the ranks' entry modules once, so that every fork starts
with them; the forked child starts a rank by module name (``layers`` and ``ranks-by-name`` in
pyproject.toml).
"""
