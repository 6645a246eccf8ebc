"""Keras 3: ``SBCCallback`` — ``model.fit`` with SBC and communication delay on several ranks.

Why a callback. With Keras 3 (3.15 here), Horovod 0.28.1's ``horovod.tensorflow.keras`` wraps
the *legacy* optimizer API (``get_gradients`` / ``_compute_gradients``) that Keras 3 optimizers no
longer have, and its tape calls ``.ref()`` on Keras 3 variables (upstream issue #4290). An
optimizer wrapper or a custom ``train_step`` would have to reach into Keras internals that change
between releases. A callback uses only public, stable hooks: ``model.fit`` trains each rank with
your own, unmodified optimizer, and after every batch the callback runs :meth:`SBC.step` on the
model's trainable variables — the communication-delay algorithm of the SBC paper (local steps,
then the weight update is SBC-compressed, allgathered, averaged into the shared weights; every
rank continues from the shared weights plus its own unsent residual, or from the shared weights
alone with ``SBC(local_residual=False)``). ``delay=1`` synchronizes after every batch.

Rules of the road:

* every rank must run the same number of batches (shard your data evenly), as with Horovod;
* the sync counts ``on_train_batch_end`` calls, i.e. one per ``steps_per_execution`` batches;
* only trainable floating-point variables are exchanged; non-trainable state (e.g. BatchNorm
  moving statistics) stays local;
* the sync runs eagerly (outside the compiled train function), so a NaN on any rank raises
  ``ValueError`` on every rank.
"""
from __future__ import annotations

from typing import Optional

import keras

from ..config import resolve_compression
from .adam import apply_freeze
from .compressor import SBC
from .owner import entries
from .tape import broadcast_variables


class SBCCallback(keras.callbacks.Callback):
    """Synchronize a Keras 3 model across Horovod ranks with SBC after every batch.

    Args:
        compression: the :class:`SBC` holding knobs and state (default ``SBC()``); put it in your
            ``tf.train.Checkpoint`` next to the model and optimizer to resume exactly.
        broadcast: at the start of the first ``fit`` (while the SBC state is not built yet),
            broadcast ``model.variables`` from ``root_rank`` so all ranks start equal.
        root_rank: the rank whose initial weights everyone starts from.
        sync_on_end: at the end of ``fit``, exchange what is left of a partial delay window and
            (with ``local_residual=True``) average the ranks' residuals into the weights
            (:meth:`SBC.finish`), so that all ranks end with identical weights.

    ``callback.stats()`` gives the traffic figures (see :meth:`SBC.stats`).
    """

    def __init__(self, compression: Optional[SBC] = None, *, broadcast: bool = True,
                 root_rank: int = 0, sync_on_end: bool = True):
        super().__init__()
        compression = resolve_compression(SBC, compression, "horovod_sbc.tensorflow.SBC")
        self.sbc = compression
        self.broadcast = broadcast
        self.root_rank = root_rank
        self.sync_on_end = sync_on_end

    def stats(self):
        return self.sbc.stats()

    def _variables(self):
        return self.model.trainable_variables

    def on_train_begin(self, logs=None):
        opt = self.model.optimizer
        apply_freeze(opt, self.sbc.config.freeze_variance_after)  # before fit traces its step
        variables = self._variables()
        names = {e[0] for e in entries(variables)}
        if not names.issubset(set(self.sbc.reference.keys())):
            if self.broadcast:
                broadcast_variables(self.model.variables, self.root_rank)
            self.sbc.build(variables)

    def _optimizer(self):
        """The model's optimizer when it steps once per batch end (the variance freeze counts
        its steps)."""
        if int(getattr(self.model, "steps_per_execution", 1) or 1) != 1:
            return None
        return self.model.optimizer

    def on_train_batch_end(self, batch, logs=None):
        self.sbc.step(self._variables(), self._optimizer())

    def on_train_end(self, logs=None):
        if not self.sync_on_end:
            return
        if self.sbc.local_residual:
            self.sbc.finish(self._variables())
        elif int(self.sbc.local_steps.numpy()) > 0:
            self.sbc.synchronize(self._variables())
