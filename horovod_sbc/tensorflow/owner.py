"""Which variable is this gradient? The one place that reads Horovod's frames (TensorFlow).

Stock ``hvd.DistributedGradientTape`` / ``hvd.DistributedOptimizer`` call
``compression.compress(grad)`` with no name, and Horovod offers no public way to learn it. Its
``allreduce_grads(grads, vars)`` (``horovod/tensorflow/__init__.py``) holds both lists a few
frames up — more inside ``tf.function``, where TensorFlow's tracing and ``tf.cond`` add their
own frames — so the lookup reads, read-only, the locals ``grads``, ``vars`` and ``op`` of frames
of Horovod's own TensorFlow package (``HOROVOD_MODULE``) only, matching the gradient by identity.
Nothing of Horovod is modified.

What this reads of Horovod is pinned for the Horovod release this package is built against by
``tests/test_owner.py``. The names that key a variable's state (:func:`variable_name`) and the
canonical order of a sync's variables (:func:`entries`) are defined here too.
"""
from __future__ import annotations

import sys
from typing import List, Tuple

import tensorflow as tf

#: the Horovod release whose frames this module reads (tests/test_owner.py checks the source)
HOROVOD_VERSION = "0.28.1"
HOROVOD_MODULE = "horovod.tensorflow"
#: how many callers are looked at: Horovod's frame is within a few outside ``tf.function`` and
#: within a few dozen inside it (TensorFlow's tracing and control flow sit in between)
MAX_FRAMES = 80


def tf_variable(v) -> tf.Variable:
    """The ``tf.Variable`` behind ``v`` (a Keras 3 ``Variable`` wraps one as ``.value``)."""
    if isinstance(v, tf.Variable):
        return v
    inner = getattr(v, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    raise TypeError(f"SBC needs variables (tf.Variable or keras.Variable), got {type(v).__name__}"
                    " (gradients of plain tensors cannot be given a residual)")


def entries(variables) -> List[Tuple[str, tf.Variable, int]]:
    """(name, tf.Variable, index in ``variables``) of the floating-point variables, sorted by
    name (one canonical message order on every rank); names must be unique."""
    out = []
    for i, v in enumerate(tf.nest.flatten(variables)):
        tv = tf_variable(v)
        if tv.dtype.is_floating:
            out.append((variable_name(v), tv, i))
    names = [e[0] for e in out]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"SBC: variable names must be unique; duplicated: {', '.join(dups)} "
                         "(give your tf.Variables distinct names)")
    return sorted(out, key=lambda e: e[0])


def variable_name(v) -> str:
    """The name that keys a variable's state: Keras 3 ``path``, else the tf.Variable's name."""
    if not isinstance(v, tf.Variable):
        path = getattr(v, "path", None)
        if isinstance(path, str):
            return path
    name = getattr(v, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"SBC needs variables (tf.Variable or keras.Variable), got "
                        f"{type(v).__name__}")
    return name[:-2] if name.endswith(":0") else name


def identify(tensor) -> Tuple[str, bool]:
    """(the variable's name, Horovod's op is Sum) for the gradient ``tensor``; ``ValueError``
    when no Horovod caller holds it, or for an op SBC cannot serve (Adasum)."""
    import horovod.tensorflow as hvd
    f = sys._getframe(2)
    for _ in range(MAX_FRAMES):
        if f is None:
            break
        if str(f.f_globals.get("__name__", "")).startswith(HOROVOD_MODULE):
            loc = f.f_locals
            grads, tvars = loc.get("grads"), loc.get("vars")
            if isinstance(grads, list) and isinstance(tvars, (list, tuple)):
                op = loc.get("op", hvd.Average)
                if op == hvd.Adasum:
                    raise ValueError("SBC cannot be combined with op=hvd.Adasum: Adasum combines "
                                     "dense vectors pairwise. Use op=hvd.Average (the default).")
                if op not in (hvd.Average, hvd.Sum):
                    raise ValueError(f"SBC supports op=hvd.Average or hvd.Sum, not {op!r}")
                for g, v in zip(grads, tvars):
                    if g is tensor:
                        return variable_name(v), op == hvd.Sum
        f = f.f_back
    raise ValueError(
        "SBC.compress() could not tell which variable this tensor is the gradient of. Use it "
        "as compression= of hvd.DistributedGradientTape, or use "
        "horovod_sbc.tensorflow.DistributedGradientTape.")
