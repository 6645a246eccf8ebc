"""A deliberately hung torchrun job: rank 1 never joins the barrier."""
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(3600)
dist.barrier()
