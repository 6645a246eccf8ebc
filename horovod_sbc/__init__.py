"""horovod_sbc — Sparse Binary Compression for Horovod."""
__version__ = "0.1.0"
