"""The built-in compressors, one file each; importing this package registers them
(:mod:`horovod_sbc.registry`). ``horovod_sbc`` imports it, so every mode is known as soon as any
part of the package is.

========== ======================================================= ==========================
mode       what a tensor message carries                           file
========== ======================================================= ==========================
``sbc``    the side with the larger mean: positions + that mean    :mod:`.sbc`
``values`` top-k positions + their float32 values (FedAvg: all)    :mod:`.topk`
``sign``   every element's sign + one scale                        :mod:`.sign`
``terngrad`` random positions + their signs + one scale            :mod:`.terngrad`
========== ======================================================= ==========================
"""
from . import sbc, topk, sign, terngrad, stc  # noqa: F401,I001 (registration, in this order)
