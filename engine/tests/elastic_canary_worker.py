"""torchrun --max-restarts=1 tests/elastic_canary_worker.py: does a restarted attempt meet the previous one's keys?

Attempt 0 makes a stock gloo process group, then rank 1 dies (-9) and the agent restarts both. In attempt 1 rank 0
looks into the agent's store, as the stock init_process_group would, for rank 1's gloo address: still there from the
dead process ("stale": torch #135712) or absent until this attempt's rank 1 writes it ("fresh": fixed upstream).
"""

import datetime
import os
import sys

import torch.distributed as dist

env = os.environ
if env["TORCHELASTIC_RESTART_COUNT"] == "1":
    if env["RANK"] == "0":
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        print("stale" if store.check(["default_pg/0//cpu//0/1"]) else "fresh", flush=True)
    sys.exit(0)
dist.init_process_group("gloo", rank=int(env["RANK"]), world_size=2, timeout=datetime.timedelta(seconds=30))
dist.barrier()
if env["RANK"] == "1":
    os.kill(os.getpid(), 9)
dist.barrier()  # rank 0 fails here; the agent restarts both
