"""One run on the driver: the controller and its attempts, membership, the restart policy, stall detection, local and barrier attempts, planning, payload, failures into exceptions."""
