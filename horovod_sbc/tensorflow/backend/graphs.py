"""Graph functions shared by every call of the TF codec: traced once per process and kind."""
import tensorflow as tf


def shared(fn, signature):
    """``fn`` as a ``tf.function`` with this input signature, no AutoGraph, and kept out of line
    (``_noinline``): each call (each gradient of the stock tape, each user ``tf.function``) is
    one call op, so TensorFlow builds and optimizes ``fn``'s ops once, not once per call."""
    return tf.function(fn, input_signature=signature, autograph=False,
                       experimental_attributes={"_noinline": True})
