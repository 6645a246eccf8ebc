"""TensorFlow adapter of horovod_sbc (codec bridge; the training integration is tracked in issue #5)."""
try:
    import tensorflow  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by tests/test_imports.py in a subprocess
    raise ImportError("horovod_sbc.tensorflow needs TensorFlow: pip install "
                      "'horovod_sbc[tensorflow]' (and Horovod built with HOROVOD_WITH_TENSORFLOW=1; "
                      "see scripts/install.sh)") from e

from .codec import compress, decompress

__all__ = ["compress", "decompress"]
