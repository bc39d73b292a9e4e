"""Write what psutil shows of this rank's own process (its command line and name) to
$TITLE_DIR/title-RANK.json."""

import json
import os

import psutil

me = psutil.Process()
with open(os.path.join(os.environ["TITLE_DIR"], f"title-{os.environ['RANK']}.json"), "w") as fh:
    json.dump({"cmdline": me.cmdline(), "name": me.name(), "pid": os.getpid()}, fh)
