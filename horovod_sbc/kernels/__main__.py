"""``python -m horovod_sbc.kernels``: compile the C kernels now (as ``scripts/install.sh`` does)
and print the library's path; when TensorFlow is importable, also the TensorFlow op library
(:func:`horovod_sbc.kernels.build_tf`). Exits non-zero with the compiler's message if that fails."""
import importlib.util

from . import build, build_tf

print(build())
if importlib.util.find_spec("tensorflow") is not None:
    print(build_tf())
