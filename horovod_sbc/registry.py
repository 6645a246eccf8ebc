"""The compressors this package knows, by the name ``SBCConfig.mode`` takes.

A compressor is one file (``horovod_sbc/compressors/<name>.py`` for the built-in ones, or any
module of yours) holding a :class:`Compressor` subclass and a call to :func:`register`. It
states what its tensor messages carry (the flags of :mod:`horovod_sbc.wire`: positions and one
value, VALUES, SIGNS, ALL), how it selects (its numpy reference, the oracle every backend is held
to), and how each framework encodes it. Every decoder already handles every message the wire
allows, so a compressor never touches a decoder; ``docs/compressors.md`` works one example
through.

This module imports nothing of the package beyond the format layer: lower layers (the numpy
reference, the torch and TensorFlow codecs, ``SBCConfig``) look compressors up by name at run
time, and the compressor files (a layer above the backends) register themselves when
``horovod_sbc`` is imported.
"""
from __future__ import annotations

from typing import Dict, Tuple


class Compressor:
    """One compressor. Subclasses set the class attributes and implement the encoders.

    The encoders take the flat residual-corrected update ``A = R + dW`` and return what was
    sent, never changing ``A``; the caller commits the error feedback (``A[positions] -=
    sent``) only after the exchange succeeded.
    """
    #: the ``mode`` name users pass (``SBC(mode=...)``)
    name: str = ""
    #: one line for error messages and the docs
    summary: str = ""
    #: one value for the whole message (SBC, signSGD, TernGrad) rather than one per position
    binarize: bool = False
    #: draws random numbers (the adapters then keep a seeded generator in their checkpoint)
    random: bool = False

    def capacity(self, numel: int, density: float) -> int:
        """The most bytes a tensor message of ``numel`` elements (> 0) may take at ``density``
        (what ``fixed_size=True`` pads every message to)."""
        raise NotImplementedError(f"compressor {self.name!r} gives no capacity")

    def encode_np(self, a, density: float, selection: str, uniform=None):
        """numpy reference: (message bytes, positions int64, sent values in ``a``'s dtype) for
        flat finite non-empty ``a`` (float32 or float64). ``uniform``: for a random compressor,
        one float32 draw in [0, 1) per element."""
        raise NotImplementedError(f"compressor {self.name!r} has no numpy reference")

    def encode_torch(self, a, density: float, name: str, selection: str, generator=None):
        """torch: (message uint8, positions int64, sent values in ``a``'s dtype) for flat
        non-empty ``a``, on its device; raises ``horovod_sbc.torch.backend.NonFiniteError`` on
        NaN/Inf."""
        raise NotImplementedError(f"compressor {self.name!r} has no torch encoder")

    def encode_tf(self, a, density: float, selection: str, name: str, generator=None):
        """TensorFlow: a ``horovod_sbc.tensorflow.backend.codec.Encoded`` for flat non-empty ``a``
        (graph-safe: no host read; a non-finite ``a`` sets ``Encoded.finite`` False).
        ``generator``: for a random compressor, the stateless seed (int64 ``[2]``) of its
        draws."""
        raise NotImplementedError(f"compressor {self.name!r} has no TensorFlow encoder")

    def __repr__(self) -> str:
        return f"<compressor {self.name!r}: {self.summary}>"


_REGISTRY: Dict[str, Compressor] = {}


def register(compressor: Compressor) -> Compressor:
    """Make ``compressor`` available as ``SBC(mode=compressor.name)``; returns it."""
    if not isinstance(compressor, Compressor):
        raise TypeError(f"register() takes a Compressor instance, got "
                        f"{type(compressor).__name__}")
    name = compressor.name
    if not name or not isinstance(name, str):
        raise ValueError("a compressor needs a non-empty name")
    old = _REGISTRY.get(name)
    if old is not None and type(old) is not type(compressor):
        raise ValueError(f"a compressor named {name!r} is already registered ({old!r})")
    _REGISTRY[name] = compressor
    return compressor


def get(name) -> Compressor:
    """The compressor registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    c = _REGISTRY.get(name) if isinstance(name, str) else None
    if c is None:
        raise ValueError(f"mode must be one of {names()}, got {name!r}")
    return c


def names() -> Tuple[str, ...]:
    return tuple(_REGISTRY)
