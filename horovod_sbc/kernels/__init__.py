"""SBC's CPU kernels (``sbc_kernels.c``), compiled on first use and called through ``ctypes``.

The torch codec's tensor ops run on any device, but on the CPU each stage costs several passes
and int64 temporaries; these kernels do each stage in one pass of plain C, so that compressing
and decoding cost a few passes over memory, like a ``torch.add`` of the same size. They take
contiguous float32 CPU tensors of at most ``MAX_NUMEL`` (2**32 - 1) elements (positions are
32-bit inside) and CPU step buffers; everything else (CUDA tensors, other dtypes,
SIGNS/VALUES/ALL messages) takes the tensor-op path, and so does everything when the kernels are
unavailable or disabled. Both paths produce the same bytes and the same verdicts: the golden
vectors and the differential test run through each. The entry points: ``sbc_select`` (and
``_diff``, ``_consume``), the exact selection and fixed-order means of
:mod:`horovod_sbc.reference`; ``sbc_gap_shift_sums`` / ``sbc_rice_encode``, the Rice streams;
``sbc_encode_binary_many`` / ``sbc_commit_binary_many``, a whole sync's SBC messages and their
error feedback in one call each; ``sbc_decode_batch``, a gathered step's positions and stream statistics; ``sbc_scatter_add_*``,
the rank-ordered sums. What each computes, the SIMD variants and the build:
docs/design.md#the-cpu-kernels (``sbc_kernels.c`` has the details).

``HOROVOD_SBC_KERNELS=0`` (read at import) disables them, :func:`disabled` for a block of code
(tests); ``HOROVOD_SBC_SIMD=sse2`` or ``=c`` asks for an older SIMD variant (the same bytes).
The library is built with ``-ffp-contract=off`` (never ``-ffast-math``) into
``$HOROVOD_SBC_KERNELS_DIR`` or ``~/.cache/horovod_sbc/kernels``, keyed by a hash of the source,
the compiler command and the platform; ``python -m horovod_sbc.kernels`` builds ahead of time.
TensorFlow: :func:`tf_ops` builds ``sbc_tf_ops.cc`` (the same kernels as the CPU custom ops
``SbcEncode``, ``SbcDecode``, ``SbcScatterAdd``) the same way and loads it with
``tf.load_op_library``; docs/tensorflow.md#the-backends-what-runs-where says how.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).with_name("sbc_kernels.c")
TF_SOURCE = Path(__file__).with_name("sbc_tf_ops.cc")
FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
# the C object linked into the TF op library: FLAGS without -shared
C_OBJECT_FLAGS = [f for f in FLAGS if f != "-shared"] + ["-c"]
TF_FLAGS = ["-O2", "-fPIC", "-shared", "-w", "-ffp-contract=off", "-fno-fast-math"]

OK, NONFINITE, NOMEM, BADARG = 0, 1, -1, -2

_lib = None
_tried = False
_disabled = 0


def _compiler() -> list:
    return shlex.split(os.environ.get("CC", "cc"))


def cache_dir() -> Path:
    d = os.environ.get("HOROVOD_SBC_KERNELS_DIR")
    return Path(d) if d else Path.home() / ".cache" / "horovod_sbc" / "kernels"


def library_path() -> Path:
    """Where the compiled library for this source, compiler and platform lives."""
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    h.update(" ".join(_compiler() + FLAGS).encode())
    h.update(f"{platform.machine()}-{platform.system()}-{sys.byteorder}".encode())
    return cache_dir() / f"sbc_kernels-{h.hexdigest()[:16]}.so"


def _run(cmd) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr.strip()}")


def _build_into(out: Path, make) -> Path:
    """Build ``out`` unless it exists: ``make(tmp)`` writes a private temporary file in the cache
    directory, which is then renamed into place (concurrent ranks building at once each write
    their own file; the last rename wins, and every file is complete)."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    try:
        make(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build() -> Path:
    """Compile ``sbc_kernels.c`` if needed; returns the library's path (raises on failure)."""
    return _build_into(library_path(), lambda tmp: _run(_compiler() + FLAGS +
                                                         ["-o", tmp, str(SOURCE), "-lm"]))


def _cxx() -> list:
    return shlex.split(os.environ.get("CXX", "g++"))


def _tf_flags():
    import tensorflow as tf
    return tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def tf_library_path() -> Path:
    """Where the TensorFlow op library for these sources, compilers, flags and TF version lives."""
    version, cflags, lflags = _tf_flags()
    h = hashlib.sha256()
    for src in (SOURCE, TF_SOURCE):
        h.update(src.read_bytes())
    h.update(" ".join(_compiler() + C_OBJECT_FLAGS + ["|"] + _cxx() + TF_FLAGS + cflags
                      + ["|"] + lflags).encode())
    h.update(f"tf-{version}-{platform.machine()}-{platform.system()}-{sys.byteorder}".encode())
    return cache_dir() / f"sbc_tf_ops-{h.hexdigest()[:16]}.so"


def build_tf() -> Path:
    """Compile the TensorFlow op library if needed (``sbc_kernels.c`` as a C object with ``cc``,
    linked with ``sbc_tf_ops.cc`` by ``g++``); returns its path (raises on failure)."""
    _, cflags, lflags = _tf_flags()

    def make(tmp):
        obj = tmp + ".o"
        try:
            _run(_compiler() + C_OBJECT_FLAGS + ["-o", obj, str(SOURCE)])
            _run(_cxx() + TF_FLAGS + cflags + ["-o", tmp, str(TF_SOURCE), obj] + lflags
                 + ["-lm"])
        finally:
            if os.path.exists(obj):
                os.unlink(obj)

    return _build_into(tf_library_path(), make)


_tf_ops = None
_tf_tried = False

MAX_NUMEL = (1 << 32) - 1  # the kernels' limit per tensor (32-bit positions); larger: tensor ops


# read once, at import (the codec asks for the library several times per tensor)
_ENV_OFF = os.environ.get("HOROVOD_SBC_KERNELS", "1") == "0"


def _enabled() -> bool:
    return not _disabled and not _ENV_OFF


def _load_once(load, what: str, fallback: str):
    """``load()`` (build and load), or None with one warning naming ``what`` and ``fallback``
    (no compiler, no headers, read-only cache, ...)."""
    try:
        return load()
    except Exception as e:
        warnings.warn(f"horovod_sbc: {what} unavailable ({e}); {fallback} (same bytes, slower "
                      "on the CPU)")
        return None


def tf_ops():
    """The loaded TensorFlow op module (``tf.load_op_library``), or None (disabled, or it could
    not be built or loaded: warned once)."""
    global _tf_ops, _tf_tried
    if not _enabled():
        return None
    if not _tf_tried:
        _tf_tried = True

        def load():
            import tensorflow as tf
            return tf.load_op_library(str(build_tf()))
        _tf_ops = _load_once(load, "TensorFlow kernel ops",
                             "the TF codec uses stock TensorFlow ops instead")
    return _tf_ops


_I64, _P = ctypes.c_int64, ctypes.c_void_p


_INT, _NONE = ctypes.c_int, None
# (argument types, return type) of every exported kernel (sbc_kernels.c documents them)
_SIGNATURES = {
    "sbc_select": ([_P, _P, _I64, _I64, _INT, _P, _P, _P, _P], _INT),
    "sbc_select_diff": ([_P, _P, _I64, _I64, _INT, _P, _P, _P, _P], _INT),
    "sbc_select_consume": ([_P, _P, _I64, _I64, _INT, _P, _P, _P, _P], _INT),
    "sbc_take": ([_INT, _P], _INT),
    "sbc_release": ([], _NONE),
    "sbc_gap_shift_sums": ([_P, _I64, _P, _I64, _P], _NONE),
    "sbc_scatter_add_mask_groups": ([_I64] + [_P] * 7 + [_INT], _INT),
    "sbc_scatter_add_also_groups": ([_I64] + [_P] * 7, _INT),
    "sbc_add_at": ([_P, _P, _I64, ctypes.c_float], _NONE),
    "sbc_rice_encode": ([_P, _I64, _I64, _P, _I64, _P, _I64], _INT),
    "sbc_decode_batch": ([_P, _I64, _I64] + [_P] * 8, _INT),
    "sbc_positions": ([_I64, _I64, _P], _INT),
    "sbc_scatter_add_groups": ([_I64] + [_P] * 6 + [_INT], _INT),
    "sbc_simd_level": ([], _INT),
    "sbc_encode_binary_many": ([_I64] + [_P] * 5 + [_INT] + [_P] * 4 + [_I64] + [_P] * 6, _INT),
    "sbc_commit_binary_many": ([_I64] + [_P] * 5, _NONE),
}


def _bind(lib) -> None:
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


def lib():
    """The loaded library, or None (disabled, or it could not be built: warned once)."""
    global _lib, _tried
    if not _enabled():
        return None
    if not _tried:
        _tried = True

        def load():
            handle = ctypes.CDLL(str(build()))
            _bind(handle)
            return handle
        _lib = _load_once(load, "C kernels", "the tensor-op codec is used instead")
    return _lib


def available() -> bool:
    return lib() is not None


@contextlib.contextmanager
def disabled():
    """Within the block, :func:`lib` returns None (the tensor-op paths run)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1
