"""Variable-length uint8 allgather: the transport SBC uses. argv: OUT {torch|tf}."""
import hashlib
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import write_result  # noqa: E402

fw = sys.argv[2]
if fw == "torch":
    import torch
    import horovod.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    mine = torch.arange(10 + 7 * r, dtype=torch.int64).remainder(251).to(torch.uint8) + r
    out = hvd.allgather(mine, name="transport")
    data = bytes(out.numpy().tobytes())
    dtype = str(out.dtype).replace("torch.", "")
else:
    import tensorflow as tf
    import horovod.tensorflow as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    mine = tf.cast((tf.range(10 + 7 * r) % 251) + r, tf.uint8)
    out = hvd.allgather(mine)
    data = bytes(out.numpy().tobytes())
    dtype = out.dtype.name
write_result(r, {"rank": r, "size": n, "len": len(data), "dtype": dtype,
                 "sha": hashlib.sha256(data).hexdigest(), "bytes": list(data)})
