"""python -S gloo_exit_worker.py RANK PORT MARKER [leave]: does rank 0 exit cleanly while its gloo worker still holds
an all_reduce? (torch #190489; classifier_engine/compat/gloo_exit.py)

Rank 0 starts an all_reduce that rank 1 joins only once rank 0 is in its last exit handler, which holds the GIL in C
(no bytecode, so no switch): the worker's release of the tensor, whose Python object it owns since rank 0 dropped it,
waits for the GIL into finalization, where Python ends the thread with pthread_exit (std::terminate: SIGABRT). With
`leave`, classifier_engine's handler runs after those and leaves with os._exit(3). Run with -S: a site's own exit
handler (some sites register one) would run bytecode last and hand the GIL over in time.
"""

import atexit
import os
import sys
import time
from pathlib import Path

rank, port, marker, leave = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4:] == ["leave"]
finalized = marker.with_name(f"{marker.name}.finalized")
if leave:
    from classifier_engine.compat import gloo_exit  # registers its handler first: it runs after the two below
if rank == 0:
    atexit.register(sum, range(120_000_000))  # ~1.6 s in C, holding the GIL, the last of the stock handlers
    atexit.register(marker.touch)  # runs first: rank 1 joins now


class Yields:
    def __del__(self):  # in finalization (module teardown): the main thread lets the waiting worker take the GIL
        finalized.touch()
        time.sleep(0.05)


yields = Yields()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if rank == 0:
    dist.all_reduce(torch.ones(8), async_op=True)  # neither the tensor nor the work kept: the worker holds the last
    if leave:
        gloo_exit.leave_at_exit(3)  # the code the process ends with, whatever SystemExit says
    sys.exit(0)
while not marker.exists():
    time.sleep(0.01)
time.sleep(0.2)
dist.all_reduce(torch.ones(8))
os._exit(0)  # rank 1 is not the case under test: its own exit skips the same window
