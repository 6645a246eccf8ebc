"""``python -m horovod_sbc.kernels``: compile the C kernels now (as ``scripts/install.sh`` does)
and print the library's path; exits non-zero with the compiler's message if that fails."""
from . import build

print(build())
