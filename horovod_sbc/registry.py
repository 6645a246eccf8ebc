"""The compressors this package knows, by the name ``SBCConfig.mode`` takes.

A compressor is one file (``horovod_sbc/compressors/<name>.py`` for the built-in ones, or any
module of yours) holding a :class:`Compressor` subclass and a call to :func:`register`. It
states what its tensor messages carry (the flags of :mod:`horovod_sbc.wire`: positions and one
value, VALUES, SIGNS, ALL), how it selects (its numpy reference, the oracle every backend is held
to), and how each framework encodes it. Every decoder already handles every message the wire
allows, so a compressor never touches a decoder; ``docs/compressors.md`` works one example
through.

What the backends need to know of a compressor it declares as attributes, never by its name:
``native_kernel`` (the backends' own top-k encoders, the C kernels and the fused device codec,
encode it; otherwise its ``encode_torch``/``encode_tf`` run), ``message`` (a :class:`Message`:
one value for every position, one float32 value each, or one sign bit each) and ``sides`` (the
candidate sides of the paper's selection: 2 for SBC, 1 for a top-k of ``|A|``).

This module imports nothing of the package beyond the format layer: lower layers (the numpy
reference, the torch and TensorFlow codecs, ``SBCConfig``) look compressors up by name at run
time, and the compressor files (a layer above the backends) register themselves when
``horovod_sbc`` is imported.
"""
from __future__ import annotations

import enum
from typing import Dict, Tuple


class Message(enum.Enum):
    """What a compressor's tensor messages carry besides their positions (the forms of
    :mod:`horovod_sbc.wire`; every decoder reads each)."""
    #: one value for every position sent (no flag): SBC
    BINARY = "positions + one value for all of them"
    #: one float32 value per position (flag VALUES, + ALL for every element): top-k, FedAvg
    VALUES = "positions + one float32 value each"
    #: one sign bit per position and one value (flag SIGNS, + ALL): signSGD, TernGrad, STC
    SIGNS = "positions + one sign bit each + one value"


#: the (message, sides) pairs the backends' own encoders implement (``native_kernel=True``):
#: SBC's binarized top-k of two candidate sides, and top-k of ``|A|`` with float32 values
NATIVE_FORMS = ((Message.BINARY, 2), (Message.VALUES, 1))
#: the (message, sides) pairs the torch fused device codec implements (``fused=True``): the
#: native ones, and the non-zero entries among the top k of ``|A|`` sent as ``sign * mu``, mu
#: their mean magnitude (STC)
FUSED_FORMS = NATIVE_FORMS + ((Message.SIGNS, 1),)


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
    #: what its tensor messages carry (:class:`Message`); ``binarize`` is ``message`` is not
    #: ``Message.VALUES``. Backends read it: a :class:`Message.BINARY` update's error feedback
    #: subtracts its one value, any other keeps ``A - sent`` per position.
    message: Message = None  # type: ignore[assignment]
    #: the candidate sides its selection takes with ``selection="paper"``: 2 (the largest
    #: positive and the most negative entries, SBC) or 1 (one top-k, of ``|A|``)
    sides: int = 1
    #: the backends' own encoders take it (the torch C kernels and fused device codec, the TF
    #: ops codec and, for ``Message.BINARY``, the TF kernel op): only for the
    #: ``(message, sides)`` of :data:`NATIVE_FORMS`, and then ``encode_torch``/``encode_tf`` are
    #: never called; ``False`` (a new compressor): its own encoders run in every backend
    native_kernel: bool = False
    #: the torch fused device codec encodes every tensor of a sync at once (a fixed number of
    #: ops and host reads, what a GPU needs): for the ``(message, sides)`` of
    #: :data:`FUSED_FORMS`, exactly as its ``encode_np`` (golden vectors hold the two equal);
    #: every ``native_kernel`` compressor is ``fused``; the C kernels encode the ternary fused
    #: form too (their top k, the rest per tensor), so its ``encode_torch`` runs only where
    #: neither does (a CUDA tensor alone, a dtype the kernels do not take)
    fused: bool = False

    def capacity(self, numel: int, density: float) -> int:
        """The most bytes a tensor message of ``numel`` elements (> 0) may take at ``density``
        (what ``fixed_size=True`` pads every message to)."""
        raise NotImplementedError(f"compressor {self.name!r} gives no capacity")

    def encode_np(self, a, density: float, selection: str, uniform=None):
        """numpy reference: (message bytes, positions int64, sent values in ``a``'s dtype) for
        flat finite non-empty ``a`` (float32 or float64). ``uniform``: for a random compressor,
        one float32 draw in [0, 1) per element."""
        raise NotImplementedError(f"compressor {self.name!r} has no numpy reference")

    def encode_torch(self, a, *, density: float, selection: str, name: str, generator=None):
        """torch: (message uint8, positions int64, sent values in ``a``'s dtype) for flat
        non-empty ``a``, on its device; raises ``horovod_sbc.torch.backend.NonFiniteError`` on
        NaN/Inf (naming ``name``). ``generator``: for a random compressor, the seeded
        ``torch.Generator`` of its draws. Called only when ``native_kernel`` is False."""
        raise NotImplementedError(f"compressor {self.name!r} has no torch encoder")

    def encode_tf(self, a, *, density: float, selection: str, name: str, generator=None):
        """TensorFlow: a ``horovod_sbc.tensorflow.backend.codec.Encoded`` for flat non-empty ``a``
        (graph-safe: no host read; a non-finite ``a`` sets ``Encoded.finite`` False).
        ``generator``: for a random compressor, the stateless seed (int64 ``[2]``) of its
        draws. Called only when ``native_kernel`` is False."""
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
    _check_declarations(compressor)
    _REGISTRY[name] = compressor
    return compressor


def _check_declarations(c: Compressor) -> None:
    """``ValueError`` unless the attributes the backends read are consistent."""
    if not isinstance(c.message, Message):
        raise ValueError(f"compressor {c.name!r} must declare its message form (message = "
                         f"registry.Message.BINARY, VALUES or SIGNS), got {c.message!r}")
    if bool(c.binarize) != (c.message is not Message.VALUES):
        raise ValueError(f"compressor {c.name!r}: binarize={c.binarize} contradicts its "
                         f"message {c.message.name} (binarize: one value for the message)")
    if c.sides not in (1, 2):
        raise ValueError(f"compressor {c.name!r}: sides must be 1 or 2, got {c.sides!r}")
    if c.fused and ((c.message, c.sides) not in FUSED_FORMS or c.random):
        raise ValueError(f"compressor {c.name!r}: the fused codec implements only "
                         f"{[(m.name, k) for m, k in FUSED_FORMS]} (message, sides), without "
                         f"random draws, not ({c.message.name}, {c.sides}"
                         f"{', random' if c.random else ''}); declare fused=False")
    if c.native_kernel and not c.fused:
        raise ValueError(f"compressor {c.name!r}: native_kernel=True needs fused=True (the "
                         f"fused codec is one of the backends' own encoders)")
    if c.native_kernel and (c.message, c.sides) not in NATIVE_FORMS:
        raise ValueError(f"compressor {c.name!r}: the backends' own encoders implement only "
                         f"{[(m.name, k) for m, k in NATIVE_FORMS]} (message, sides), not "
                         f"({c.message.name}, {c.sides}); declare native_kernel=False and give "
                         f"encode_torch/encode_tf")


def get(name) -> Compressor:
    """The compressor registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    c = _REGISTRY.get(name) if isinstance(name, str) else None
    if c is None:
        raise ValueError(f"mode must be one of {names()}, got {name!r}")
    return c


def load_file(path: str) -> None:
    """Import the compressor file at ``path`` (e.g. ``tests/user_compressor.py``), which
    registers its compressor; a file imported before (by its module name) is not run again."""
    import importlib
    import os
    import sys
    folder, stem = os.path.split(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.import_module(os.path.splitext(stem)[0])


def names() -> Tuple[str, ...]:
    return tuple(_REGISTRY)
