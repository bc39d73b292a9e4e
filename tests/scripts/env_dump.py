"""Write this rank's torchrun environment to OUTDIR/rank-N.json and join a gloo all_reduce."""

import json
import os
import sys

import torch
import torch.distributed as dist

KEYS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "EXTRA_VAR",
]

outdir = sys.argv[1]
dist.init_process_group("gloo", init_method="env://")
t = torch.ones(1)
dist.all_reduce(t)
info = {k: os.environ.get(k) for k in KEYS}
info["sum"] = t.item()
info["argv"] = sys.argv[2:]
with open(os.path.join(outdir, f"rank-{os.environ['RANK']}.json"), "w") as fh:
    json.dump(info, fh)
print(f"env written by rank {os.environ['RANK']}")
dist.destroy_process_group()
