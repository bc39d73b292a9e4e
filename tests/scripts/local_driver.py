"""A driver that runs spawn_grandchild.py in local mode, for tests that kill the driver."""

import os
import sys

from spark_torch import Distributor

Distributor(num_processes=2).run(os.path.join(os.path.dirname(__file__), "spawn_grandchild.py"))
sys.exit(0)
