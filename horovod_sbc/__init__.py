"""horovod_sbc — Sparse Binary Compression for Horovod."""
__version__ = "0.1.0"

from . import compressors  # noqa: E402,F401 (registers the built-in compressors)
