"""A worker entry for tests/distributed/test_ray.py's fault test: what rlflow.launch.ray runs in each actor in
place of rlflow.trainer.main_ppo, so that a dying or failing rank costs seconds, not a training run.

``main(["raise"])``: rank 1 raises, naming the torchrun variables it was given; ``main(["die"])``: rank 1's
process exits at once (as a killed or out-of-memory process); every other rank waits, as a rank stuck in a
collective would, until the launcher stops it.
"""

import os
import time


def main(argv):
    if os.environ["RANK"] != "1":
        time.sleep(600)
        return 0
    if argv[0] == "die":
        os._exit(3)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    raise RuntimeError("bad shard: " + " ".join(f"{n}={os.environ.get(n)}" for n in names))
