"""A deliberately hung job: rank 1 never joins the collective."""
import sys
import time

import horovod.torch as hvd
import torch

hvd.init()
if hvd.rank() == 1:
    time.sleep(3600)
hvd.allreduce(torch.ones(1), name="never_completes")
