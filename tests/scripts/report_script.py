"""A torchrun-style training script that reports metrics and a checkpoint each epoch and
resumes from the latest checkpoint: the same file runs under torchrun (no reports then) or
spark_torch."""

import json
import os
import tempfile

import torch.distributed as dist

import spark_torch

dist.init_process_group("gloo", init_method="env://")
epochs = int(os.environ.get("EPOCHS", "3"))
start = 0
checkpoint = spark_torch.get_checkpoint()
if checkpoint is not None:
    start = json.loads((checkpoint / "state.json").read_text())["epoch"] + 1
for epoch in range(start, epochs):
    with tempfile.TemporaryDirectory() as tmp:
        if dist.get_rank() == 0:
            with open(os.path.join(tmp, "state.json"), "w") as fh:
                json.dump({"epoch": epoch}, fh)
        spark_torch.report({"epoch": epoch, "loss": 1.0 / (epoch + 1)}, checkpoint=tmp)
dist.destroy_process_group()
