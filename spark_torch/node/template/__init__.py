"""Warm rank starts: the template server, its client, the forked child, and their protocol."""
