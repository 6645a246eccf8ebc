"""The residual manager: the one place that holds SBC's per-tensor state.

GRACE calls this the *Memory*. One :class:`ResidualManager` is shared by a compressor (which reads
and writes residuals while encoding) and an optimizer (which owns the communication delay's
reference weights ``W_ref``), and it is what checkpoints save and restore so that a resumed run
continues exactly:

* ``residuals[name]``  — error feedback: everything of ``R + dW`` that was not sent yet;
* ``reference[name]``  — the shared weights every rank agreed on at the last sync (delay > 1);
* ``server_residuals`` — the server's error feedback for a compressed downlink (rank 0 of the
  ``"server"`` topology only);
* ``counters``         — cumulative traffic figures of this rank (see :meth:`stats`).

It is framework-agnostic: tensors are whatever the adapter stores (torch tensors, tf.Variables);
the adapter passes a factory to create missing entries.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

COUNTER_KEYS = ("upstream_bits", "downstream_bits", "dense_bits", "syncs", "steps",
                "server_in_bits", "server_out_bits", "positions_sent", "elements_synced",
                "intra_node_bits", "padding_bits")
STATE_FORMAT = 1


class ResidualManager:
    def __init__(self) -> None:
        self.residuals: Dict[str, Any] = {}
        self.reference: Dict[str, Any] = {}
        self.server_residuals: Dict[str, Any] = {}
        self.counters: Dict[str, int] = {k: 0 for k in COUNTER_KEYS}
        self.config: Dict[str, Any] = {}

    # -- state ------------------------------------------------------------------------------
    def residual(self, name: str, factory: Callable[[], Any]) -> Any:
        t = self.residuals.get(name)
        if t is None:
            t = self.residuals[name] = factory()
        return t

    def add(self, **figures: int) -> None:
        for k, v in figures.items():
            self.counters[k] += int(v)

    def stats(self) -> Dict[str, int]:
        """Cumulative figures for this rank.

        upstream_bits   bits this rank sent (real message sizes, headers included)
        padding_bits    of those, the zero padding of fixed-size step messages
                        (``fixed_size``; the rest is the messages' content)
        downstream_bits bits this rank received from the other ranks (topology "server": the
                        downlink messages; 0 on the root, which makes them)
        server_in_bits  root of topology "server": uplink bits received from the other ranks
        server_out_bits root of topology "server": downlink bits sent (message x other ranks)
        dense_bits      32 x element count x steps: an uncompressed fp32 upload at every step
        positions_sent  positions this rank's uplink messages carried (committed syncs)
        elements_synced elements those messages described (numel x syncs): the measured
                        density is positions_sent / elements_synced
        intra_node_bits hierarchical exchange: bits this rank sent to the other ranks of its
                        node (dense reduce-scatter, the decoded shard shared, status flags;
                        each collective counted as a direct exchange)
        syncs           number of exchanges
        steps           number of optimizer steps (local steps count, delay > 1)
        """
        return dict(self.counters)

    def state_dict(self) -> Dict[str, Any]:
        return {"format": STATE_FORMAT, "residuals": dict(self.residuals),
                "reference": dict(self.reference), "counters": dict(self.counters),
                "server_residuals": dict(self.server_residuals),
                "config": dict(self.config)}

    def load_state_dict(self, state: Dict[str, Any], copy: Callable[[Any, Any], Any]) -> None:
        """Restore from :meth:`state_dict`; ``copy(dst_or_None, src)`` returns the stored tensor."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("not a horovod_sbc residual state (missing or unknown 'format')")
        saved_cfg = state.get("config", {})
        for key in ("world_size", "rank", "hierarchy"):
            if key in saved_cfg and key in self.config and saved_cfg[key] != self.config[key]:
                raise ValueError(
                    f"checkpoint was saved with {key}={saved_cfg[key]!r} but this run uses "
                    f"{key}={self.config[key]!r}; residuals are only valid for the same setting")
        self.residuals = {k: copy(self.residuals.get(k), v) for k, v in state["residuals"].items()}
        self.reference = {k: copy(self.reference.get(k), v) for k, v in state["reference"].items()}
        self.server_residuals = {k: copy(self.server_residuals.get(k), v)
                                 for k, v in state.get("server_residuals", {}).items()}
        self.counters = {k: int(state["counters"].get(k, 0)) for k in COUNTER_KEYS}
