"""``SBC``: the compressor object, usable as ``compression=`` of stock ``hvd.DistributedOptimizer``.

One state object (like PyTorch's ``PowerSGDState``) holding the knobs and the
:class:`~horovod_sbc.residual.ResidualManager`; the drop-in
:func:`horovod_sbc.torch.DistributedOptimizer` uses the same object for its fused exchange.
"""
from __future__ import annotations

import sys
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import wire
from ..core import keep_count, validate_density, validate_selection
from ..residual import ResidualManager
from . import exchange
from .codec import NonFiniteError, _scratch, encode_positions, encode_update, subtract_sent_

_NONFINITE = ("raise", "skip")


def _restore(res: torch.Tensor, upd: torch.Tensor) -> None:
    """Undo ``res += upd`` after a failed encode; entries made non-finite by a NaN/Inf in
    ``upd`` cannot be recovered and are reset to 0 (only on the failing rank)."""
    res.sub_(upd)
    torch.nan_to_num_(res, nan=0.0, posinf=0.0, neginf=0.0)


def _mask_momentum(optimizer, param: torch.Tensor, avg: torch.Tensor) -> None:
    """DGC momentum factor masking on the global buffer (stock path, see ``momentum_masking``):
    zero ``optimizer.state[param]["momentum_buffer"]`` where the averaged update ``avg`` (flat)
    is non-zero. Runs before the optimizer's step; on-device, no host transfer."""
    state = getattr(optimizer, "state", None)
    buf = state.get(param, {}).get("momentum_buffer") if state is not None else None
    if isinstance(buf, torch.Tensor) and buf.numel() == avg.numel():
        buf.view(-1).masked_fill_(avg != 0, 0)


def _update_of(item, dtype: torch.dtype) -> torch.Tensor:
    """The flat update of an exchange item: ``value`` or ``value - base`` in a reused buffer."""
    value = item[1].reshape(-1)
    if len(item) < 4 or item[3] is None:
        return value
    buf = _scratch(value.numel(), dtype, value.device, slot=1)
    return torch.sub(value.to(dtype), item[3].reshape(-1).to(dtype), out=buf)


def _residual_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp16/bf16 updates are accumulated in fp32 (small updates would vanish in 16 bits)
    return torch.float64 if dtype == torch.float64 else torch.float32


class SBC:
    r"""Sparse Binary Compression (Sattler et al., "Sparse Binary Compression: Towards Distributed
    Deep Learning with minimal Communication", arXiv 1805.08768).

    Each rank sends, per tensor, the positions of the ``density`` fraction of its largest positive
    or of its most negative residual-corrected update entries, whichever side has the larger mean
    (Golomb-Rice coded), and one float: that mean. What is not sent stays in a residual and is added next time (error
    feedback), so nothing is lost, only delayed. Messages travel by ``allgather``; every rank
    decodes all of them and averages, so all ranks apply bit-identical updates.

    Args:
        density: the paper's *p*, in (0, 1]: with the default ``selection="paper"`` each rank
            sends ``k = round(p * numel)`` positions per tensor (at least 1; fewer only when the
            winning sign has fewer than k entries), so ``stats()["positions_sent"] /
            stats()["elements_synced"]`` is about p. 0.01 sends 1 %; about 8 bits per position
            after Golomb coding. Lower is smaller and, with error feedback, usually
            still converges; the paper goes down to 0.001-0.0001 combined with ``delay``.
        delay: the paper's *n*, communication delay: every rank runs ``delay`` local optimizer
            steps, then the accumulated weight update is compressed and exchanged. Only the
            drop-in :func:`horovod_sbc.torch.DistributedOptimizer` can delay; with stock
            ``hvd.DistributedOptimizer`` it must be 1 (gradients are compressed every step).
        binarize: True (SBC) sends one mean per tensor; False sends the kept entries' own float32
            values (top-k sparsification with error feedback, ~32 more bits per position).
        selection: ``"paper"`` (default; SBC paper's Algorithm 1): the top-k positive and the
            top-k negative entries are the two candidate sides. ``"magnitude"``: the top-k by
            magnitude split by sign (the side sent then has only ~0.5-0.65 k positions, so the
            effective density is about half of ``density``). Binarized SBC only.
        topology: ``"allgather"`` (default): every rank receives every rank's message, so the
            download per rank grows with the number of workers. ``"server"``: rank 0 gathers the
            messages, averages, compresses the average again with its own residual at
            ``downlink_density`` and broadcasts one message (Zou et al., arXiv 2209.15203);
            downlink bytes then stay flat in the number of workers. Needs Horovod's MPI
            controller (``horovodrun --mpi``, ``mpirun``) and the drop-in optimizer.
        downlink_density: fraction kept by the server's top-k of the average (``"server"`` only);
            ``None`` sends the average dense (32 bits per element), for comparison.
        downlink_binarize: binarize the downlink like SBC (one mean) instead of sending the kept
            values (plain top-k, as in the paper).
        nonfinite: what to do when an update holds NaN/Inf. ``"raise"``: every rank raises
            ``ValueError`` naming the rank and parameter. ``"skip"``: every rank skips the sync
            (a warning names the parameter); the weights stay at the last shared state, healthy
            ranks keep their update in the residual, the failing rank drops its non-finite one.
        named_parameters: optional ``model.named_parameters()``. Stock Horovod passes no name to
            ``compress()``; by default SBC reads it from Horovod's optimizer that called it. Pass
            this if you call ``compress()`` from elsewhere.
        momentum_masking: stock ``hvd.DistributedOptimizer`` only (the drop-in keeps the
            residual in the local weights instead, see :mod:`horovod_sbc.torch.optimizer`).
            There the optimizer's momentum acts on the averaged sparse update ("global"
            momentum): a coordinate arrives only every ~1/p steps, in one burst holding all its
            delayed gradient, and the momentum buffer then replays that burst for ~1/(1-m) more
            steps on top of the stale velocity it already had. True (default): DGC's momentum
            factor masking (Lin et al., ICLR 2018) on the global buffer: where the averaged
            update is non-zero, the owner optimizer's SGD ``momentum_buffer`` is zeroed just
            before its step, so the burst restarts the velocity instead of adding to a stale
            one. The buffer is the same on every rank, so ranks stay identical. Optimizers
            without ``momentum_buffer`` state (Adam, ...) are left alone. Measured on mnist1d
            (4 workers, SGD momentum 0.9, docs/benchmarks.md): p=0.1 74.0 % -> 88.9 %, p=0.01
            90.8 % -> 91.9 % (dense 94.6 %); the drop-in optimizer does better still.
    """

    def __init__(self, density: float = 0.01, delay: int = 1, binarize: bool = True,
                 nonfinite: str = "raise", named_parameters=None, topology: str = "allgather",
                 downlink_density: Optional[float] = None, downlink_binarize: bool = False,
                 selection: str = "paper", momentum_masking: bool = True):
        if not isinstance(momentum_masking, bool):
            raise ValueError(f"momentum_masking must be True or False, got {momentum_masking!r}")
        self.momentum_masking = momentum_masking
        self.density = validate_density(density)
        self.selection = validate_selection(selection)
        if topology not in ("allgather", "server"):
            raise ValueError(f"topology must be 'allgather' or 'server', got {topology!r}")
        if downlink_density is not None:
            if topology != "server":
                raise ValueError("downlink_density applies to topology='server' only")
            downlink_density = validate_density(downlink_density)
        self.topology = topology
        self.downlink_density = downlink_density
        self._downlink_mode = "sbc" if downlink_binarize else "values"
        if not isinstance(delay, int) or isinstance(delay, bool) or delay < 1:
            raise ValueError(f"delay must be an integer >= 1, got {delay!r}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}")
        self.delay = delay
        self.binarize = bool(binarize)
        self._mode = "sbc" if self.binarize else "values"
        self._gen = None
        self.nonfinite = nonfinite
        self.manager = ResidualManager()
        self.manager.config.update(density=self.density, delay=delay, binarize=self.binarize,
                                   topology=topology, selection=self.selection)
        self._named = list(named_parameters) if named_parameters is not None else None
        self._calls: Dict[str, int] = {}  # compress() calls per tensor (stock path)
        self._owner = None  # (Horovod optimizer, parameter) of the last compress() (stock path)
        self._warned_momentum = False
        self._max_calls = 0

    def _generator(self, device) -> Optional[torch.Generator]:
        return None

    def __repr__(self) -> str:
        return (f"SBC(density={self.density}, delay={self.delay}, binarize={self.binarize}, "
                f"nonfinite={self.nonfinite!r})")

    # -- statistics / state -----------------------------------------------------------------
    def stats(self) -> Dict[str, int]:
        """Cumulative figures of this rank: upstream_bits, downstream_bits, dense_bits, syncs,
        steps (see :meth:`horovod_sbc.residual.ResidualManager.stats`)."""
        return self.manager.stats()

    def state_dict(self):
        return self.manager.state_dict()

    def load_state_dict(self, state) -> None:
        """Restore residuals and counters. Residuals are per rank: loading a checkpoint written
        by another rank or by a job of another size raises ValueError (a changed ``density`` is
        fine: the residual is still the update mass not sent yet)."""
        try:
            self._world()  # record this job's size and rank to compare with the checkpoint's
        except (RuntimeError, ImportError, ValueError):
            pass

        def copy(dst, src):
            if dst is not None and dst.shape == src.shape:
                return dst.copy_(src)
            return src.detach().clone()
        self.manager.load_state_dict(state, copy)

    def _residual(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return self.manager.residual(
            name, lambda: torch.zeros(like.numel(), dtype=_residual_dtype(like.dtype),
                                      device=like.device))

    def _world(self) -> Tuple[int, int]:
        import horovod.torch as hvd
        if not hvd.is_initialized():
            raise RuntimeError("horovod is not initialized: call hvd.init() first")
        size, rank = hvd.size(), hvd.rank()
        self.manager.config.update(world_size=size, rank=rank)
        return size, rank

    # -- fused exchange (used by the drop-in optimizer) ----------------------------------------
    def exchange(self, items: Sequence[Tuple], out: Optional[List[torch.Tensor]] = None,
                 tag: str = "sbc.sync") -> Optional[List[torch.Tensor]]:
        """Compress, allgather (one fused message), decode and average a set of updates.

        ``items`` are ``(name, value, shape)`` or ``(name, value, shape, base)``: the update is
        ``value`` (flat) or ``value - base`` (computed into a reused buffer, e.g. weights minus
        reference weights). Each residual gets the update added and, once every rank's message
        decoded, what was sent subtracted. The average of all ranks' decoded updates is added to
        ``out`` (flat tensors, e.g. the reference weights) or to new zero tensors, which are
        returned. Returns None if the sync was skipped (``nonfinite="skip"``); raises
        ``ValueError`` on every rank if any rank failed.
        """
        size, rank = self._world()
        layout = [(it[0], tuple(it[2])) for it in items]
        fp = wire.layout_fingerprint(layout)
        dev = items[0][1].device if items else torch.device("cpu")
        pending = []
        step = None
        local_error = False
        for it in items:
            name, value = it[0], it[1]
            res = self._residual(name, value)
            if res.numel() != value.numel():
                raise ValueError(f"SBC: {name!r} has {value.numel()} elements but its residual "
                                 f"has {res.numel()}; did the model change shape?")
            upd = _update_of(it, res.dtype)
            res.add_(upd)  # A = R + dW, in place (error feedback is committed below)
            try:
                msg, pos, sent = encode_update(res, self.density, self._mode, name,
                                               self._generator(res.device), self.selection)
            except NonFiniteError as e:
                _restore(res, upd)
                step = exchange.error_frame(str(e), fp, self.nonfinite == "skip", dev, rank)
                local_error = True
                break
            pending.append((it, res, pos, sent, msg))
        if step is None:
            step = exchange.frame([p[4] for p in pending], fp, dev)
        try:
            if self.topology == "server":
                out = self._server_exchange(step, layout, size, rank, out, self._sum_dtype(items))
            else:
                gathered = exchange.allgather(step, tag)
                self.manager.add(upstream_bits=8 * step.numel(),
                                 downstream_bits=8 * (gathered.numel() - step.numel()))
                out = exchange.decode_gathered(gathered, layout, size, out, 1.0 / size,
                                               self._sum_dtype(items))
        except wire.PeerError as e:
            if e.skip:
                warnings.warn(f"horovod_sbc: skipping this sync: {e}")
                if local_error:  # the failing rank drops this window's update
                    for it, res, _, _, _ in pending:
                        _restore(res, _update_of(it, res.dtype))
                # healthy ranks keep R + dW in the residual: nothing sent, nothing lost
                return None
            raise ValueError(f"SBC: {e}") from None
        for _, res, pos, sent, _ in pending:  # commit error feedback only after success
            subtract_sent_(res, pos, sent)
        self.manager.add(syncs=1, positions_sent=sum(p[2].numel() for p in pending),
                         elements_synced=sum(p[1].numel() for p in pending))
        return out

    def _server_exchange(self, step: torch.Tensor, layout, size: int, rank: int, out,
                         sum_dtype) -> List[torch.Tensor]:
        """Server topology (Zou, De Sterck, Liu, "Downlink Compression Improves TopK
        Sparsification", arXiv 2209.15203): rank 0 gathers every rank's step message (a real MPI
        gather: nothing goes to the other workers), decodes and averages them, adds its own
        server residual, compresses the average at ``downlink_density`` and broadcasts that one
        message; every rank, rank 0 included, applies the same decoded downlink."""
        from . import server
        root = 0
        gathered = server.gather(step, root)
        self.manager.add(upstream_bits=8 * step.numel())
        down = None
        if rank == root:
            self.manager.add(server_in_bits=8 * (gathered.numel() - step.numel()))
            down = self._server_step(gathered, layout, size, sum_dtype, step.device)
        down = server.broadcast(down, root, step.device)
        if rank == root:
            self.manager.add(server_out_bits=8 * down.numel() * (size - 1))
        else:
            self.manager.add(downstream_bits=8 * down.numel())
        return exchange.decode_gathered(down, layout, 1, out, 1.0, sum_dtype)

    def _server_step(self, gathered, layout, size, sum_dtype, dev) -> torch.Tensor:
        """Root only: the downlink step message for the gathered uplinks (or an error frame
        that makes every rank fail or skip together)."""
        fp = wire.layout_fingerprint(layout)
        try:
            avg = exchange.decode_gathered(gathered, layout, size, None, 1.0 / size, sum_dtype)
        except wire.PeerError as e:
            return exchange.error_frame(e.reason, fp, e.skip, dev, e.rank)  # relay it
        except ValueError as e:  # a malformed uplink: everybody must hear about it
            return exchange.error_frame(f"the server rejected an uplink: {e}", fp, False, dev, 0)
        msgs = []
        srv = self.manager.server_residuals
        for (name, _), a in zip(layout, avg):
            if self.downlink_density is None:  # dense downlink: exact average, no residual
                msg, _, _ = encode_update(a, 1.0, "values", name)
            else:
                r = srv.get(name)
                if r is None or r.numel() != a.numel():
                    r = srv[name] = torch.zeros_like(a)
                r.add_(a)  # server-side error feedback
                msg, pos, sent = self._encode_downlink(r, name)
                subtract_sent_(r, pos, sent)
            msgs.append(msg)
        return exchange.frame(msgs, fp, dev)

    def _encode_downlink(self, r: torch.Tensor, name: str):
        """The server's message for residual-corrected average ``r``: never a zero-valued
        position. With few ranks the average often has fewer non-zeros than the downlink's k
        (2 ranks at p=0.01 sending 2k positions at most, the downlink keeping k of a sparser
        sum), so k is min(k, non-zeros) (one count crosses to the host)."""
        n = r.numel()
        k = keep_count(n, self.downlink_density)
        nz = int(torch.count_nonzero(r)) if n else 0
        if nz == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=r.device)
            return encode_positions(empty, n), empty, r.new_zeros(0)
        density = self.downlink_density if nz >= k else nz / n
        return encode_update(r, density, self._downlink_mode, name, selection=self.selection)

    @staticmethod
    def _sum_dtype(items) -> torch.dtype:
        return torch.float64 if any(it[1].dtype == torch.float64 for it in items) else \
            torch.float32

    # -- stock horovod.torch.DistributedOptimizer interface -----------------------------------
    def _identify(self, tensor: torch.Tensor) -> str:
        """Which parameter is ``tensor`` the gradient of? (Horovod passes no name.)

        Horovod's optimizer calls ``compress(p.grad)`` from ``_allreduce_grad_async(p)`` (or from
        a comprehension over ``p`` in its grouped variant); we look at that caller's ``self`` and
        ``p`` (read-only frame inspection, nothing of Horovod is modified) and take the name from
        its ``_parameter_names``, matching by identity with ``p.grad``.
        """
        f = sys._getframe(2)
        for _ in range(3):
            if f is None:
                break
            loc = f.f_locals
            owner = loc.get("self")
            if owner is not None and hasattr(owner, "_parameter_names"):
                if hasattr(owner, "_starting_models"):  # horovod's _DistributedAdasumOptimizer
                    raise ValueError(
                        "SBC cannot be combined with op=hvd.Adasum: Adasum combines dense vectors "
                        "pairwise. Use op=hvd.Average (the default) or "
                        "horovod_sbc.torch.DistributedOptimizer.")
                import horovod.torch as hvd
                op = getattr(owner, "op", hvd.Average)
                if op not in (hvd.Average, hvd.Sum):
                    raise ValueError(f"SBC supports op=hvd.Average or hvd.Sum, not {op!r}")
                self._op_sum = op == hvd.Sum
                p = loc.get("p")
                # Horovod hands compress() p.grad, or its dense copy with sparse_as_dense=True
                if p is not None and p.grad is not None and (
                        p.grad is tensor or (p.grad.is_sparse and not tensor.is_sparse
                                             and tensor.shape == p.shape)):
                    name = owner._parameter_names.get(p)
                    if name is not None:
                        self._owner = (owner, p)
                        return name
            f = f.f_back
        self._owner = None
        if self._named is not None:
            for name, p in self._named:
                if p.grad is tensor:
                    return name
        raise ValueError(
            "SBC.compress() could not tell which parameter this tensor belongs to. Use it as "
            "compression= of hvd.DistributedOptimizer(..., named_parameters=...), pass "
            "named_parameters= to SBC(...), or use horovod_sbc.torch.DistributedOptimizer.")

    def compress(self, tensor: torch.Tensor):
        """Horovod hook: start the allgather of this gradient's message; returns a 1-element dummy
        for Horovod's allreduce (the real data travels by allgather) and the context."""
        if self.delay != 1:
            raise ValueError(
                f"SBC(delay={self.delay}) needs local steps between syncs, which stock "
                "hvd.DistributedOptimizer cannot do: use horovod_sbc.torch.DistributedOptimizer("
                "optimizer, named_parameters, compression=SBC(..., delay=n)).")
        if self.topology != "allgather":
            raise ValueError("SBC(topology='server') needs the fused exchange of "
                             "horovod_sbc.torch.DistributedOptimizer; stock "
                             "hvd.DistributedOptimizer sends one message per tensor")
        self._op_sum = False
        name = self._identify(tensor)
        if tensor.is_sparse:
            raise ValueError(f"SBC: gradient of {name!r} is sparse; pass sparse_as_dense=True to "
                             "hvd.DistributedOptimizer")
        size, rank = self._world()
        layout = [(name, tuple(tensor.shape))]
        fp = wire.layout_fingerprint(layout)
        res = self._residual(name, tensor)
        upd = tensor.detach().reshape(-1)
        res.add_(upd)  # A = R + g, in place; error feedback committed in decompress()
        a = res
        try:
            msg, pos, sent = encode_update(res, self.density, self._mode, name,
                                           self._generator(res.device), self.selection)
            step = exchange.frame([msg], fp, tensor.device)
        except NonFiniteError as e:
            _restore(res, upd)
            step = exchange.error_frame(str(e), fp, self.nonfinite == "skip", tensor.device,
                                        rank)
            a = None
        handle = exchange.allgather_async(step, f"sbc.{name}")
        calls = self._calls[name] = self._calls.get(name, 0) + 1
        if calls > self._max_calls:  # the first tensor of a new step (stock path: sync = step)
            self._max_calls = calls
            self.manager.add(steps=1, syncs=1)
        self._warn_momentum()
        owner = self._owner if self.momentum_masking else None
        ctx = (name, handle, step.numel(), layout, a, (pos, sent) if a is not None else None,
               tensor, size, self._op_sum, owner)
        dummy = tensor.new_zeros(1)
        self.manager.add(upstream_bits=8 * dummy.numel() * dummy.element_size(),
                         dense_bits=32 * tensor.numel())
        return dummy, ctx

    def decompress(self, output: torch.Tensor, ctx) -> torch.Tensor:
        """Horovod hook: finish the allgather, decode every rank's message and average."""
        name, handle, sent_len, layout, a, commit, grad, size, op_sum, owner = ctx
        gathered = exchange.synchronize(handle)
        self.manager.add(upstream_bits=8 * sent_len,
                         downstream_bits=8 * (gathered.numel() - sent_len))
        # the gradient was added to the residual in compress(): its buffer is free, so the
        # average is decoded into it (no new tensor-sized allocation per step)
        out = grad if grad.is_contiguous() else torch.empty_like(grad)
        flat = out.view(-1)
        try:
            exchange.decode_gathered(gathered, layout, size, [flat.zero_()],
                                     1.0 if op_sum else 1.0 / size)
        except wire.PeerError as e:
            if not e.skip:
                raise ValueError(f"SBC: {e}") from None
            warnings.warn(f"horovod_sbc: skipping this step for {name!r}: {e}")
            # healthy ranks keep the gradient in the residual for next time
            return flat.zero_().view(grad.shape)
        subtract_sent_(a, *commit)
        self.manager.add(positions_sent=commit[0].numel(), elements_synced=a.numel())
        if owner is not None:
            _mask_momentum(owner[0], owner[1], flat)
        return out

    def _warn_momentum(self) -> None:
        """Once per compressor: stock hook + an SGD-style optimizer with momentum (README)."""
        if self._warned_momentum or self._owner is None:
            return
        self._warned_momentum = True
        groups = getattr(self._owner[0], "param_groups", [])
        if any(g.get("momentum", 0) for g in groups):
            warnings.warn(
                f"horovod_sbc: {type(self).__name__} through stock hvd.DistributedOptimizer with "
                "momentum: the optimizer's momentum then acts on sparse, stale "
                "updates, and on mnist1d (4 workers, SGD momentum 0.9) this trained worse than "
                "no communication at all (docs/benchmarks.md). Use "
                "horovod_sbc.torch.DistributedOptimizer (local_residual=True) instead.",
                stacklevel=4)


class TopK(SBC):
    """Top-k sparsification with error feedback (as in DGC / GRACE): the kept entries' own float32
    values are sent (``SBC(binarize=False)``), positions Golomb-Rice coded like SBC's.

    Args: ``density``, ``delay`` as :class:`SBC`; ``momentum_masking`` as :class:`SBC` but off by
    default: top-k sends exact values, and masking the global buffer then only removes the
    momentum those values should get (measured: docs/benchmarks.md). ``topology="server"``
    with ``downlink_density`` is the setting of "Downlink Compression Improves TopK
    Sparsification" (Zou, De Sterck, Liu; arXiv 2209.15203): top-k values up, the server's top-k
    (with its own error feedback) of the average down (``downlink_density=None``: dense down).
    """

    def __init__(self, density: float = 0.01, delay: int = 1, nonfinite: str = "raise",
                 named_parameters=None, topology: str = "allgather",
                 downlink_density: Optional[float] = None, momentum_masking: bool = False):
        super().__init__(density=density, delay=delay, binarize=False, nonfinite=nonfinite,
                         named_parameters=named_parameters, topology=topology,
                         downlink_density=downlink_density, momentum_masking=momentum_masking)

    def __repr__(self) -> str:
        extra = (f", topology='server', downlink_density={self.downlink_density}"
                 if self.topology == "server" else "")
        return f"TopK(density={self.density}, delay={self.delay}{extra})"


class FedAvg(SBC):
    """Communication delay alone (federated averaging / local SGD): every ``delay`` local steps
    the dense weight update is averaged (``SBC(density=1.0, binarize=False, delay=n)``); needs
    the drop-in :func:`horovod_sbc.torch.DistributedOptimizer` for ``delay > 1``.
    """

    def __init__(self, delay: int = 4, nonfinite: str = "raise", named_parameters=None):
        super().__init__(density=1.0, delay=delay, binarize=False, nonfinite=nonfinite,
                         named_parameters=named_parameters)


class SignSGD(SBC):
    """Error-feedback signSGD (Karimireddy et al., "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes", ICML 2019): every element is sent as ``sign(A) * mean(|A|)``,
    one bit per element plus one float per tensor; the difference stays in the residual.

    Args: ``delay`` as :class:`SBC` (``density`` does not apply).
    """

    def __init__(self, delay: int = 1, nonfinite: str = "raise", named_parameters=None):
        super().__init__(density=1.0, delay=delay, binarize=True, nonfinite=nonfinite,
                         named_parameters=named_parameters)
        self._mode = "sign"
        self.manager.config.update(mode="sign")

    def __repr__(self) -> str:
        return f"SignSGD(delay={self.delay}, nonfinite={self.nonfinite!r})"


class TernGrad(SBC):
    """TernGrad (Wen et al., NeurIPS 2017): each element is sent as ``max|A| * sign(A)`` with
    probability ``|A| / max|A|`` (unbiased stochastic ternarization), positions Golomb-Rice coded
    plus one sign bit each and one float per tensor. Here the residual (error feedback) is kept
    too, like every compressor of this package.

    Args:
        seed: seeds this rank's random stream (``seed + rank``), so runs are reproducible.
        delay: as :class:`SBC`.
    """

    def __init__(self, delay: int = 1, seed: int = 0, nonfinite: str = "raise",
                 named_parameters=None):
        super().__init__(density=1.0, delay=delay, binarize=True, nonfinite=nonfinite,
                         named_parameters=named_parameters)
        self._mode = "terngrad"
        self.seed = int(seed)
        self.manager.config.update(mode="terngrad")

    def _generator(self, device) -> torch.Generator:
        if self._gen is None or self._gen.device != torch.device(device):
            _, rank = self._world()
            self._gen = torch.Generator(device=device)
            self._gen.manual_seed(self.seed + 1_000_003 * rank)
            saved, self._saved_gen = getattr(self, "_saved_gen", None), None
            if saved is not None:  # resume the random stream where the checkpoint left it
                self._gen.set_state(saved)
        return self._gen

    def state_dict(self):
        """As :meth:`SBC.state_dict`, plus this rank's random generator state, so a resumed run
        draws the same stochastic roundings as an uninterrupted one."""
        st = super().state_dict()
        if self._gen is not None:
            st["generator"] = self._gen.get_state()
        return st

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        self._saved_gen = state.get("generator")
        self._gen = None

    def __repr__(self) -> str:
        return f"TernGrad(delay={self.delay}, seed={self.seed}, nonfinite={self.nonfinite!r})"
