"""One run on the driver: the controller and its attempts, membership, the restart policy, stall detection, local and barrier attempts, planning, payload, failures into exceptions.

May import: the driver's spark, console, config and result sub-layers and what the driver may
import; never driver.api (``driver-sublayers`` in pyproject.toml).
"""
