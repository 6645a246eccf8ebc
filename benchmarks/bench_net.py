"""Bandwidth-limited network benchmark: step time of dense allreduce, fp16, top-K and SBC.

``python -m benchmarks.bench net --bandwidth 100mbit --json FILE``

Testbed (:class:`Testbed`, needs root and iproute2): every rank runs in its own Linux network
namespace ``sbcnet<pid>-r<R>`` whose only interface is one end of a veth pair; the other ends are
ports of a bridge in a launcher namespace ``sbcnet<pid>-l``, where ``mpirun`` runs. Like W
machines on one switch, each behind a link of the given rate: a token-bucket filter (``tc tbf``)
shapes both directions of every veth. All addresses (10.231.0.0/24 by default: the bridge .1,
rank R .10+R) exist only inside these namespaces; nothing is added to the host's own namespace,
so no other traffic can use the link and the link cannot leak. Open MPI runs over TCP (``--mca
btl tcp,self``: no shared memory between the ranks) and its PMIx/ORTE control traffic crosses
the same bridge (``PMIX_MCA_ptl_tcp_remote_connections=1``). Deleting the namespaces removes
everything; teardown runs on normal exit, on exceptions (try/finally), at interpreter exit
(atexit) and on SIGTERM/SIGINT/SIGHUP, and is idempotent. Namespaces left by a killed earlier run
(its pid no longer alive) are removed at the next start.

Also measured: ``loopback`` (plain ``mpirun`` on localhost, Open MPI's shared-memory transport:
communication is nearly free, what is left is compute + encode/decode) and ``unlimited`` (the
namespaces without ``tc``: TCP over veth).

Per method and bandwidth the worker runs warm-up steps, then timed steps (as many as fit a time
budget, at least one sync window) on an MLP of >= 10M parameters with synthetic data, and
reports the mean step time. Crossover (the bandwidth below which a compressed method is faster
than dense allreduce) is estimated two ways: from loopback step times plus wire bits
(``t(B) = t_loopback + wire_bits / B``) and from a least-squares fit ``t = a + c / B`` to the
rate-limited measurements.

A method entry is a dict: ``method`` (``local``, ``none``, ``fp16``, ``sbc``, ``topk``, ...),
``density``, ``delay``, ``api: "stock"`` (the stock Horovod hook instead of the drop-in),
``hierarchy``, and ``topology`` (``"allgather"``, the default, or ``"reduce_scatter"``: SBC's
sparse reduce-scatter, :mod:`horovod_sbc.torch.sync.scatter`). Every result has the step time,
``upstream_bits_per_step``/``downstream_bits_per_step`` (the compressor's ``stats()``, mean over
ranks) and ``decode_s_per_step``: the seconds spent in the codec's decode calls per step
(:class:`DecodeTimer`, mean over ranks), measured the same way for both topologies.

``python -m benchmarks.bench_net topology --workers 4 --workers 8 --bandwidth 1gbit --bandwidth
100mbit --json FILE`` (:func:`run_topology`) runs dense allreduce and SBC with each topology
(drop-in and stock hook) in turns on each rank count and writes the table (``.md``) and a plot
(``.png``) beside the JSON.
"""
from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from .bench_train import PROGRESS_TAG, RESULT_TAG, JobError, Progress, make_mlp, run_job
from horovod_sbc.launch import ENV_NAMES, job_env, launcher_prefix, python_exe

SUBNET = "10.231.0.0/24"
NS_PREFIX = "sbcnet"
FULL_SIZES = [1024, 4096, 1536, 10]     # 10,502,154 parameters
QUICK_SIZES = [512, 2048, 512, 10]      # 2,104,330 parameters
FULL_METHODS = [
    {"method": "local"},                # compute only: no communication at all
    {"method": "none"},
    {"method": "fp16"},
    {"method": "topk", "density": 0.001},
    {"method": "sbc", "density": 0.001},
    {"method": "sbc", "density": 0.01},
    {"method": "sbc", "density": 0.001, "delay": 4},
]
QUICK_METHODS = [{"method": "local"}, {"method": "none"}, {"method": "sbc", "density": 0.001}]
FULL_BANDWIDTHS = ["1gbit", "100mbit", "10mbit"]

_UNITS = {"": 1, "bit": 1, "k": 1e3, "kbit": 1e3, "m": 1e6, "mbit": 1e6, "g": 1e9, "gbit": 1e9}


def parse_bandwidth(s: str) -> Optional[float]:
    """'100mbit' -> 1e8 bit/s (tc's units: k/m/g are powers of 1000); 'loopback'/'unlimited' ->
    None."""
    t = str(s).strip().lower()
    if t in ("loopback", "unlimited", "inf", "none"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmg]?(?:bit)?)(?:/s|ps)?", t)
    if not m:
        raise ValueError(f"bandwidth {s!r}: use tc units such as 10mbit, 100mbit, 1gbit")
    v = float(m.group(1)) * _UNITS[m.group(2)]
    if v <= 0:
        raise ValueError(f"bandwidth {s!r} must be positive")
    return v


def method_label(m: dict) -> str:
    s = m["method"]
    if "density" in m:
        s += f" p={m['density']:g}"
    if m.get("delay", 1) != 1:
        s += f" n={m['delay']}"
    if m.get("topology", "allgather") != "allgather":
        s += f" {m['topology']}"
    if m.get("api") == "stock":
        s += " (stock hook)"
    if m.get("hierarchy"):
        s += " hierarchical"
    return s


# ------------------------------------------------------------------------------------------------
# the testbed
# ------------------------------------------------------------------------------------------------
def _ip() -> str:
    for p in (shutil.which("ip"), "/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip"):
        if p and os.path.exists(p):
            return p
    raise RuntimeError("iproute2's `ip` is not installed (apt-get install iproute2)")


def _tc() -> str:
    for p in (shutil.which("tc"), "/usr/sbin/tc", "/sbin/tc", "/usr/bin/tc"):
        if p and os.path.exists(p):
            return p
    raise RuntimeError("iproute2's `tc` is not installed (apt-get install iproute2)")


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def list_netns() -> List[str]:
    p = _run([_ip(), "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> List[str]:
    """Delete namespaces of earlier runs of this benchmark whose process is gone."""
    removed = []
    pat = re.compile(rf"^{NS_PREFIX}(\d+)-(l|r\d+)$")
    for ns in list_netns():
        m = pat.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _delete_ns(ns)
            removed.append(ns)
    return removed


def _delete_ns(ns: str) -> None:
    """Kill what runs inside ``ns`` (only our benchmark's processes live there), delete it."""
    ip = _ip()
    p = _run([ip, "netns", "pids", ns], check=False)
    for tok in p.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    _run([ip, "netns", "del", ns], check=False)


class Testbed:
    """W namespaces joined by rate-limited veths to a bridge in a launcher namespace.

    ``ranks_per_node`` = L > 1 makes a two-level network: the ranks are W / L nodes of L
    consecutive ranks, each node one namespace (its ranks talk over the kernel's local path,
    unshaped: the fast link inside a node) with one shaped veth to the bridge (the link between
    nodes). Use as a context manager, or call :meth:`setup` and :meth:`teardown` (idempotent).
    """

    _live: List["Testbed"] = []
    _handlers_installed = False

    def __init__(self, workers: int = 2, subnet: str = SUBNET, tag: Optional[str] = None,
                 ranks_per_node: int = 1):
        if os.geteuid() != 0:
            raise PermissionError("the network testbed needs root (network namespaces, tc)")
        net = ipaddress.ip_network(subnet)
        if not net.is_private or net.prefixlen > 26:
            raise ValueError(f"{subnet}: use a private /24 (or larger) used for nothing else")
        if workers < 1 or workers > 100:
            raise ValueError("workers must be in 1..100")
        if ranks_per_node < 1 or workers % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must divide workers={workers}")
        self.workers = workers
        self.ranks_per_node = ranks_per_node
        nodes = workers // ranks_per_node
        self.subnet = str(net)
        hosts = list(net.hosts())
        self.bridge_addr = str(hosts[0])
        self.addrs = [str(hosts[9 + r]) for r in range(nodes)]  # one per namespace
        self.prefixlen = net.prefixlen
        self.tag = tag or f"{NS_PREFIX}{os.getpid()}"
        self.launcher = f"{self.tag}-l"
        self.ranks = [f"{self.tag}-r{r}" for r in range(nodes)]  # the namespaces
        self.rate: Optional[float] = None
        self.up = False

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self):
        self.setup()
        return self

    def __exit__(self, *exc):
        self.teardown()

    @classmethod
    def _install_handlers(cls) -> None:
        if cls._handlers_installed:
            return
        cls._handlers_installed = True
        atexit.register(cls.teardown_all)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            prev = signal.getsignal(sig)

            def handler(signum, frame, prev=prev):
                cls.teardown_all()
                if callable(prev):
                    return prev(signum, frame)
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            try:
                signal.signal(sig, handler)
            except ValueError:  # not the main thread: atexit + finally still apply
                pass

    @classmethod
    def teardown_all(cls) -> None:
        for tb in list(cls._live):
            tb.teardown()

    def namespaces(self) -> List[str]:
        return [self.launcher] + self.ranks

    def setup(self) -> "Testbed":
        self._install_handlers()
        remove_stale()
        ip = _ip()
        Testbed._live.append(self)
        self.up = True
        try:
            for ns in self.namespaces():
                if ns in list_netns():
                    _delete_ns(ns)
                _run([ip, "netns", "add", ns])
            L = self.launcher
            _run([ip, "-n", L, "link", "set", "lo", "up"])
            _run([ip, "-n", L, "link", "add", "br0", "type", "bridge"])
            _run([ip, "-n", L, "addr", "add", f"{self.bridge_addr}/{self.prefixlen}", "dev", "br0"])
            _run([ip, "-n", L, "link", "set", "br0", "up"])
            for r, ns in enumerate(self.ranks):
                host_end = f"vh{r}"
                _run([ip, "-n", L, "link", "add", host_end, "type", "veth", "peer", "name", "eth0",
                      "netns", ns])
                _run([ip, "-n", L, "link", "set", host_end, "master", "br0"])
                _run([ip, "-n", L, "link", "set", host_end, "up"])
                _run([ip, "-n", ns, "link", "set", "lo", "up"])
                _run([ip, "-n", ns, "addr", "add", f"{self.addrs[r]}/{self.prefixlen}", "dev",
                      "eth0"])
                _run([ip, "-n", ns, "link", "set", "eth0", "up"])
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> None:
        """Delete this testbed's namespaces (and with them the veths, bridge and addresses).
        Safe to call any number of times, also on a half-built testbed."""
        for ns in reversed(self.namespaces()):
            if ns in list_netns():
                _delete_ns(ns)
        self.up = False
        if self in Testbed._live:
            Testbed._live.remove(self)

    # -- shaping -----------------------------------------------------------------------------------
    def _links(self):
        for r, ns in enumerate(self.ranks):
            yield self.launcher, f"vh{r}"   # towards rank r
            yield ns, "eth0"                # from rank r

    def set_rate(self, rate_bps: Optional[float]) -> None:
        """Shape every veth in both directions to ``rate_bps`` (None: no limit)."""
        ip, tc = _ip(), _tc()
        for ns, dev in self._links():
            _run([ip, "netns", "exec", ns, tc, "qdisc", "del", "dev", dev, "root"], check=False)
            if rate_bps is not None:
                # burst: >= 10 ms at this rate (and >= 32 KB) so tbf can reach the rate with
                # the kernel's timer granularity; queue limited to 50 ms of latency
                burst = max(32 * 1024, int(rate_bps / 8 / 100))
                _run([ip, "netns", "exec", ns, tc, "qdisc", "add", "dev", dev, "root", "tbf",
                      "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "50ms"])
        self.rate = rate_bps

    def measure_link(self, seconds: float = 1.0) -> float:
        """TCP throughput namespace 0 -> namespace 1 (rank 0 -> rank 1, or node 0 -> node 1) in
        Mbit/s (one stream, ~``seconds`` of data)."""
        if len(self.ranks) < 2:
            return float("nan")
        ip = _ip()
        nbytes = int(min(200e6, max(1e6, (self.rate or 10e9) / 8 * seconds)))
        port = 47000 + os.getpid() % 1000
        srv = (f"import socket,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,"
               f"socket.SO_REUSEADDR,1);s.bind(('{self.addrs[1]}',{port}));s.listen(1)\n"
               "print('ready',flush=True);c,_=s.accept();n=0;t0=None\n"
               "while True:\n d=c.recv(1<<20)\n if not d: break\n"
               " t0=t0 or time.perf_counter();n+=len(d)\n"
               "print(8*n/(time.perf_counter()-t0)/1e6,flush=True)")
        cli = (f"import socket\nc=socket.create_connection(('{self.addrs[1]}',{port}))\n"
               f"b=b'x'*(1<<20)\nfor _ in range({max(1, nbytes >> 20)}): c.sendall(b)\nc.close()")
        server = subprocess.Popen([ip, "netns", "exec", self.ranks[1], python_exe(), "-c", srv],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()  # "ready"
            _run([ip, "netns", "exec", self.ranks[0], python_exe(), "-c", cli])
            out, _ = server.communicate(timeout=60)
            return float(out.strip().splitlines()[-1])
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()

    # -- launching ---------------------------------------------------------------------------------
    def mpirun_cmd(self, argv: Sequence[str]) -> List[str]:
        ip = _ip()
        mpirun = shutil.which("mpirun")
        if not mpirun:
            raise RuntimeError("the network benchmark needs Open MPI's mpirun")
        cmd = [ip, "netns", "exec", self.launcher, mpirun, "--allow-run-as-root", "-bind-to",
               "none", "-map-by", "slot", "--mca", "btl", "tcp,self", "--mca",
               "btl_tcp_if_include", self.subnet, "--mca", "oob_tcp_if_include", self.subnet]
        if self.workers > (os.cpu_count() or 1):
            cmd.append("--oversubscribe")
        for n in ENV_NAMES + ("PMIX_MCA_ptl_tcp_remote_connections", "PMIX_MCA_ptl_tcp_if_include"):
            cmd += ["-x", n]
        for r, ns in enumerate(self.ranks):
            if r:
                cmd.append(":")
            cmd += ["-np", str(self.ranks_per_node), ip, "netns", "exec", ns] + list(argv)
        return cmd

    def env(self) -> Dict[str, str]:
        return job_env({"PMIX_MCA_ptl_tcp_remote_connections": "1",
                        "PMIX_MCA_ptl_tcp_if_include": self.subnet})


# ------------------------------------------------------------------------------------------------
# the worker (runs on every rank)
# ------------------------------------------------------------------------------------------------
TOPOLOGIES = ("allgather", "reduce_scatter")


def method_compressor(m: dict, delay: int):
    """The compressor of method entry ``m`` at ``delay``: :func:`bench_train.make_compressor`,
    or, with ``m["topology"]`` (``"allgather"``, the default, or ``"reduce_scatter"``), SBC or
    top-K built with that topology."""
    from .bench_train import make_compressor
    topology = m.get("topology", "allgather")
    if topology not in TOPOLOGIES:
        raise ValueError(f"method {method_label(m)!r}: topology {topology!r} is not one of "
                         f"{TOPOLOGIES}")
    density = float(m.get("density", 1.0))
    if topology == "allgather":
        return make_compressor(m["method"], density, delay)
    import horovod_sbc.torch as sbc
    cls = {"sbc": sbc.SBC, "topk": sbc.TopK}.get(m["method"])
    if cls is None:
        raise ValueError(f"method {m['method']!r} has no topology={topology!r} (sbc, topk only)")
    return cls(density=density, delay=delay, topology=topology)


class DecodeTimer:
    """Seconds spent in the codec's decode calls (every backend class's ``decode`` and
    ``decode_many``; a call inside another counted once), cumulative for this process. Both
    topologies decode only through these: the allgather's one ``decode`` of the gathered
    messages; the reduce-scatter's owner ``decode`` of its region's parts and ``decode_many``
    of the region messages."""

    def __init__(self):
        self.seconds, self.calls, self._depth, self._installed = 0.0, 0, 0, False

    def wrap(self, fn):
        import functools

        @functools.wraps(fn)
        def timed(*a, **kw):
            if self._depth:
                return fn(*a, **kw)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
                self._depth -= 1
        timed._decode_timer = True
        return timed

    def install(self) -> "DecodeTimer":
        if self._installed:
            return self
        from horovod_sbc.torch import backend as be
        for cls in {be.Backend, be.KernelBackend, be.OpsBackend}:
            for name in ("decode", "decode_many"):
                fn = cls.__dict__.get(name)
                if fn is not None and not getattr(fn, "_decode_timer", False):
                    setattr(cls, name, self.wrap(fn))
        self._installed = True
        return self


DECODE_TIMER = DecodeTimer()


class _MethodRun:
    """One method's model, optimizer and data on this rank, stepped by :func:`_bench_method` (all
    its steps in one block) or by :func:`_bench_interleaved` (blocks of steps in turn with the
    other methods)."""

    def __init__(self, m: dict, cfg: dict):
        import torch
        import horovod.torch as hvd
        import horovod_sbc.torch as sbc

        self.m, self.cfg = m, cfg
        rank = hvd.rank()
        self.method, self.delay = m["method"], int(m.get("delay", 1))
        self.density = float(m.get("density", 1.0))
        torch.manual_seed(0)  # identical initial weights on every rank: no 40 MB broadcast
        self.model = make_mlp(cfg["sizes"])
        self.numel = sum(p.numel() for p in self.model.parameters())
        gen = torch.Generator().manual_seed(1 + rank)
        bs = cfg["batch_size"]
        self.xs = torch.randn(4, bs, cfg["sizes"][0], generator=gen)
        self.ys = torch.randint(0, cfg["sizes"][-1], (4, bs), generator=gen)
        base = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.comp = None
        named = self.model.named_parameters()
        if self.method in ("none", "fp16"):
            c = hvd.Compression.fp16 if self.method == "fp16" else hvd.Compression.none
            self.opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=c)
        elif self.method == "local":
            self.opt = base
        elif m.get("api") == "stock":  # the one-line change: SBC as stock Horovod's compression
            self.comp = method_compressor(m, 1)
            self.opt = hvd.DistributedOptimizer(base, named_parameters=named,
                                                compression=self.comp)
        elif m.get("hierarchy"):  # dense inside each group of ranks, SBC between groups
            kw = {"topology": m["topology"]} if "topology" in m else {}
            self.comp = sbc.SBC(self.density, delay=self.delay, hierarchy=m["hierarchy"], **kw)
            self.opt = sbc.DistributedOptimizer(base, named, compression=self.comp)
        else:
            self.comp = method_compressor(m, self.delay)
            self.opt = sbc.DistributedOptimizer(base, named, compression=self.comp)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.k = 0  # steps taken
        self.times: List[float] = []  # timed steps
        self.decode_times: List[float] = []  # codec decode seconds inside each timed step
        self.st0 = None

    def warm_up(self) -> float:
        """One whole sync window (allocations, negotiation) between barriers: its seconds."""
        _barrier()
        t0 = time.perf_counter()
        for _ in range(self.delay):
            self.step()
        _barrier()
        return time.perf_counter() - t0

    def step(self) -> float:
        i = self.k
        d0 = DECODE_TIMER.seconds
        t = time.perf_counter()
        self.opt.zero_grad()
        self.loss_fn(self.model(self.xs[i % 4]), self.ys[i % 4]).backward()
        self.opt.step()
        self.k += 1
        dt = time.perf_counter() - t
        self.last_decode_s = DECODE_TIMER.seconds - d0
        return dt

    def timed_step(self) -> float:
        """A step counted in the result: its time, and its codec decode time."""
        dt = self.step()
        self.times.append(dt)
        self.decode_times.append(self.last_decode_s)
        return dt

    def start_timing(self) -> None:
        self.st0 = dict(self.comp.stats()) if self.comp is not None else None

    def result(self, warmup_s: float, total_s: Optional[float] = None) -> dict:
        import numpy as np
        import horovod.torch as hvd
        size, n, delay = hvd.size(), len(self.times), self.delay
        if self.comp is not None:
            st = self.comp.stats()
            up = (st["upstream_bits"] - self.st0["upstream_bits"]) / n
            down = (st["downstream_bits"] - self.st0["downstream_bits"]) / n
            wire = None  # ring allgather: each rank forwards W-1 messages per sync (below)
        elif self.method == "local":
            up = down = wire = 0.0
        else:
            up = down = (16 if self.method == "fp16" else 32) * self.numel
            wire = 2 * (size - 1) / size * up  # ring allreduce
        ups = hvd.allgather_object(up)
        downs = hvd.allgather_object(down)
        decs = hvd.allgather_object(sum(self.decode_times) / n)
        topology = self.comp.topology if self.comp is not None else None
        if self.comp is not None:  # what crosses each rank's link inbound (= outbound, ring)
            wire = (float(np.mean(downs)) if topology == "reduce_scatter"
                    else float(np.mean([(size - 1) * u for u in ups])))
        # median over sync windows (delay steps each) of the window's time / delay: robust to
        # the other processes of a shared machine, and still includes every window's sync
        win = [sum(self.times[i:i + delay]) / delay for i in range(0, n, delay)]
        return {"method": self.method, "label": method_label(self.m), "density": self.density,
                "delay": delay, "workers": size, "params": self.numel, "warmup_s": warmup_s,
                "topology": topology, "api": self.m.get("api", "drop-in"),
                "steps": n, "step_time_s": float(np.median(win)),
                "step_time_mean_s": (total_s if total_s is not None else sum(self.times)) / n,
                "upstream_bits_per_step": float(np.mean(ups)),
                "downstream_bits_per_step": float(np.mean(downs)),
                "downstream_bits_per_step_max": float(np.max(downs)),
                "wire_bits_per_step": wire,
                # the codec's decode calls (Backend.decode / decode_many) per step, mean over
                # the timed steps, then over ranks
                "decode_s_per_step": float(np.mean(decs)),
                "decode_s_per_step_max": float(np.max(decs)),
                "dense_bits_per_step": 32 * self.numel}


def _barrier() -> None:
    import torch
    import horovod.torch as hvd
    hvd.allreduce(torch.zeros(1), name="bench.barrier")


def _bench_method(m: dict, cfg: dict, emit) -> dict:
    """All of one method's steps in one block: a warm-up sync window, then as many windows as
    fit the time budget (at most ``max_steps`` steps)."""
    import horovod.torch as hvd
    run = _MethodRun(m, cfg)
    t_warm = run.warm_up()
    windows = int(max(1, min(cfg["max_steps"] // run.delay,
                             cfg["budget_s"] // max(t_warm, 1e-3))))
    windows = hvd.broadcast_object(windows, root_rank=0)
    n = windows * run.delay
    run.start_timing()
    _barrier()
    t0 = time.perf_counter()
    for i in range(n):
        run.timed_step()
        emit((i + 1) / n)
    _barrier()
    res = run.result(t_warm, time.perf_counter() - t0)
    del run
    return res


def _bench_interleaved(methods: List[dict], cfg: dict, emit) -> List[dict]:
    """Every method's steps in turns: ``rounds`` rounds, in each one block of ``block`` sync
    windows per method (a barrier before each block). A shared machine's slow phases then fall
    on all methods alike, where one block per method leaves each ratio to whatever the machine
    did during its block."""
    runs = [_MethodRun(m, cfg) for m in methods]
    warm = []
    for run in runs:
        warm.append(run.warm_up())
        run.start_timing()
    rounds, block = int(cfg["interleave"]["rounds"]), int(cfg["interleave"]["block"])
    for r in range(rounds):
        for run in runs:
            _barrier()
            for _ in range(block * run.delay):
                run.timed_step()
        emit((r + 1) / rounds)
    return [run.result(w) for run, w in zip(runs, warm)]


def worker_main(argv: Sequence[str]) -> int:
    import torch
    import horovod.torch as hvd
    cfg = json.loads(argv[0])
    groups = next((m["hierarchy"] for m in cfg["methods"] if m.get("hierarchy")), None)
    if groups is None:
        hvd.init()
    else:  # the node groups' process sets, declared at initialisation
        from horovod_sbc.torch import hierarchy_process_sets
        hvd.init(process_sets=hierarchy_process_sets(groups))
    torch.set_num_threads(1)
    DECODE_TIMER.install()
    rank = hvd.rank()
    if cfg.get("interleave"):
        def emit_all(frac):
            if rank == 0:
                print(PROGRESS_TAG + json.dumps({"frac": frac, "info": "interleaved"}),
                      flush=True)
        for res in _bench_interleaved(cfg["methods"], cfg, emit_all):
            if rank == 0:
                print(RESULT_TAG + json.dumps(res), flush=True)
        return 0
    for k, m in enumerate(cfg["methods"]):
        def emit(frac, k=k, m=m):
            if rank == 0:
                print(PROGRESS_TAG + json.dumps({"frac": (k + frac) / len(cfg["methods"]),
                                                 "info": method_label(m)}), flush=True)
        res = _bench_method(m, cfg, emit)
        if rank == 0:
            print(PROGRESS_TAG + json.dumps({"frac": (k + 1) / len(cfg["methods"]),
                                             "log": f"{res['label']:<18} "
                                                    f"{1000 * res['step_time_s']:9.1f} ms/step "
                                                    f"({res['steps']} steps)"}), flush=True)
            print(RESULT_TAG + json.dumps(res), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# orchestration and analysis
# ------------------------------------------------------------------------------------------------
def crossover_bps(a_dense: float, bits_dense: float, a_m: float, bits_m: float) -> Optional[float]:
    """Bandwidth (bit/s) where ``a_dense + bits_dense/B == a_m + bits_m/B``; below it the method
    is faster. ``inf``: faster at every bandwidth; ``None``: never faster (sends no fewer bits and
    costs more)."""
    if bits_m >= bits_dense:
        return float("inf") if a_m < a_dense and bits_m == bits_dense else None
    if a_m <= a_dense:
        return float("inf")
    return (bits_dense - bits_m) / (a_m - a_dense)


def fit_line(points: Sequence[tuple]) -> Optional[tuple]:
    """Fit ``t = a + c * (1/B)`` to (B, t) points, least squares on *relative* errors (weights
    1/t^2: a 60 s step at 10 Mbit/s must not drown the 0.2 s ones); None with < 2 points."""
    pts = [(1.0 / b, t) for b, t in points if b and t > 0]
    if len(pts) < 2:
        return None
    w = [1.0 / (t * t) for _, t in pts]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, pts)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, pts)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, pts))
    if sxx == 0:
        return None
    c = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, pts)) / sxx
    return my - c * mx, c


def _fmt_bps(b: Optional[float]) -> str:
    if b is None:
        return "never"
    if b == float("inf"):
        return "any (faster everywhere)"
    for unit, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if b >= f:
            return f"{b / f:.3g} {unit}"
    return f"{b:.3g} bit/s"


def _json_num(v):
    if v is None:
        return None
    if v == float("inf"):
        return "inf"
    return v


def analyse(runs: List[dict]) -> Dict[str, object]:
    """Crossover bandwidths of every method against dense allreduce ("none"), three ways:

    from_fit        fit ``t = a + c/B`` to every TCP measurement (the tc-shaped rates and the
                    unshaped veth at its measured TCP throughput), then solve a_d + c_d/B =
                    a_m + c_m/B: both the cost per step and the effective bits come from data
    from_fast_link  a = step time on the unshaped veth minus its transfer time (wire bits /
                    measured throughput), c = the wire bits we count: "compute + encode/decode
                    cost" from the fastest link, bytes from the message sizes
    from_loopback   the same with localhost shared memory as the cost (wire time ~0)
    """
    by: Dict[str, Dict[str, dict]] = {}
    for r in runs:
        by.setdefault(r["label"], {})[r["network"]] = r
    out: Dict[str, object] = {}
    dense = by.get("none", {})

    def pts(per):
        return [(r.get("effective_bps") or r.get("bandwidth_bps"), r["step_time_s"])
                for r in per.values() if r.get("effective_bps") or r.get("bandwidth_bps")]

    def base_cost(r):  # step time minus the modelled transfer time on that network
        b = r.get("effective_bps") or r.get("bandwidth_bps")
        return r["step_time_s"] - (r["wire_bits_per_step"] / b if b else 0.0)

    fit_d = fit_line(pts(dense))
    local = by.get("local", {}).get("loopback")
    for lab, per in by.items():
        if lab in ("none", "local"):
            continue
        e: Dict[str, object] = {}
        for key, net in (("from_fast_link", "unlimited"), ("from_loopback", "loopback")):
            d, m = dense.get(net), per.get(net)
            if d and m:
                b = crossover_bps(base_cost(d), d["wire_bits_per_step"], base_cost(m),
                                  m["wire_bits_per_step"])
                e[key + "_bps"] = _json_num(b)
                e[key] = _fmt_bps(b)
                e[key + "_cost_over_dense_s"] = base_cost(m) - base_cost(d)
        lp = per.get("loopback")
        if local and lp:
            e["loopback_exchange_cost_s"] = lp["step_time_s"] - local["step_time_s"]
        fm = fit_line(pts(per))
        if fm:
            e["fit"] = {"a_s": fm[0], "c_bits": fm[1]}
        if fit_d and fm:
            b = crossover_bps(fit_d[0], fit_d[1], fm[0], fm[1])
            e["from_fit_bps"] = _json_num(b)
            e["from_fit"] = _fmt_bps(b)
        e["step_time_over_dense"] = {net: per[net]["step_time_s"] / dense[net]["step_time_s"]
                                     for net in per if net in dense}
        out[lab] = e
    if fit_d:
        out["none"] = {"fit": {"a_s": fit_d[0], "c_bits": fit_d[1]},
                       "effective_rate_over_nominal": {
                           net: (r["wire_bits_per_step"] / (r["step_time_s"] - fit_d[0]))
                           / r["bandwidth_bps"]
                           for net, r in dense.items()
                           if r.get("bandwidth_bps") and r["step_time_s"] > fit_d[0]}}
    if local:
        out["compute_only_step_s"] = local["step_time_s"]
    return out


STEP_METHODS = [
    {"method": "local"},
    {"method": "none"},
    {"method": "sbc", "density": 0.01},
    {"method": "sbc", "density": 0.01, "api": "stock"},
    {"method": "sbc", "density": 0.001},
    {"method": "topk", "density": 0.01},
]
STEP_TARGET = 1.15  # issue 12: SBC step time / dense allreduce step time over loopback


def run_steptime(workers: int = 2, sizes: Optional[List[int]] = None, rounds: int = 8,
                 block: int = 4, progress: bool = True) -> Dict[str, object]:
    """Step time of SBC (drop-in and stock hook, p = 0.01, delay 1) and peers / dense allreduce
    step time, over loopback (Open MPI shared memory: what remains is compute, encode, decode
    and the collectives' own cost), 2 ranks, the 10.5M-parameter MLP. The methods take turns:
    ``rounds`` rounds of ``block`` steps each (median step per method), so that the shared
    machine's slow phases fall on the numerator and the denominator alike."""
    res = run_net((), loopback=True, unlimited=False, workers=workers, methods=STEP_METHODS,
                  sizes=sizes, progress=progress,
                  interleave={"rounds": rounds, "block": block})
    runs = {r["label"]: r for r in res["runs"]}
    dense = runs.get("none")
    res["ratios"] = {k: r["step_time_s"] / dense["step_time_s"] for k, r in runs.items()} \
        if dense else {}
    res["target"] = STEP_TARGET
    return res


def _steptime_rows(res: Dict[str, object]):
    """(label, step ms, ratio to dense) per method, and the run's description."""
    il = res["config"].get("interleave") or {}
    what = (f"loopback, {res['workers']} ranks, MLP {res['config']['sizes']}; methods in "
            f"turns: {il.get('rounds')} rounds of {il.get('block')} steps, median step")
    return what, [(r["label"], 1000 * r["step_time_s"], res["ratios"].get(r["label"], float("nan")))
                  for r in res["runs"]]


def print_steptime(res: Dict[str, object]) -> None:
    what, rows = _steptime_rows(res)
    print(f"\nstep time / dense allreduce step time ({what})")
    for label, ms, ratio in rows:
        print(f"  {label:<28} {ms:8.1f} ms   {ratio:5.2f}x")
    print(f"  target for SBC p=0.01: <= {res['target']}x")


def markdown_steptime(res: Dict[str, object]) -> str:
    what, rows = _steptime_rows(res)
    lines = [f"{what}; target for SBC p=0.01: <= {res['target']}x", "",
             "| method | step time | ÷ dense allreduce step |", "|---|---:|---:|"]
    lines += [f"| {label} | {ms:.1f} ms | {ratio:.2f}x |" for label, ms, ratio in rows]
    return "\n".join(lines)


def net_order(bandwidths: Sequence[str], loopback: bool, unlimited: bool) -> List[str]:
    nets = (["loopback"] if loopback else []) + (["unlimited"] if unlimited else [])
    shaped = sorted({b for b in bandwidths}, key=lambda b: -parse_bandwidth(b))
    return nets + shaped


def run_net(bandwidths: Sequence[str] = ("100mbit",), quick: bool = False, loopback: bool = True,
            unlimited: bool = True, workers: int = 2, methods: Optional[List[dict]] = None,
            sizes: Optional[List[int]] = None, budget_s: Optional[float] = None,
            max_steps: Optional[int] = None, timeout: float = 900,
            progress: bool = True, interleave: Optional[dict] = None,
            ranks_per_node: int = 1) -> Dict[str, object]:
    """``interleave``: ``{"rounds": R, "block": B}`` steps the methods in turns (R rounds of B
    sync windows each, see :func:`_bench_interleaved`) instead of one block per method.
    ``ranks_per_node``: the shaped networks as nodes of that many ranks (:class:`Testbed`)."""
    from .bench_train import method_available
    methods = [m for m in (methods or (QUICK_METHODS if quick else FULL_METHODS))]
    skipped = [m for m in methods if not method_available(m["method"])]
    methods = [m for m in methods if m not in skipped]
    cfg = {"sizes": sizes or (QUICK_SIZES if quick else FULL_SIZES), "batch_size": 32,
           "budget_s": budget_s or (4.0 if quick else 12.0),
           "max_steps": max_steps or (6 if quick else 16), "methods": methods}
    if interleave:
        cfg["interleave"] = dict(interleave)
    for b in bandwidths:
        parse_bandwidth(b)
    nets = net_order(bandwidths, loopback, unlimited)

    def argv_for(net):  # compute-only reference ("local") once, at loopback
        c = dict(cfg, methods=[m for m in methods if m["method"] != "local" or net == "loopback"])
        return [python_exe(), "-m", "benchmarks.bench_net", "worker", json.dumps(c)]
    res: Dict[str, object] = {"config": cfg, "workers": workers, "subnet": SUBNET, "runs": [],
                              "networks": [], "errors": [],
                              "skipped": [{"method": m["method"], "reason": "not available"}
                                          for m in skipped]}
    prog = Progress(len(nets), f"net ({workers} ranks, {len(methods)} methods each)", progress)
    tb: Optional[Testbed] = None
    try:
        for net in nets:
            bps = parse_bandwidth(net)
            info: Dict[str, object] = {"network": net, "bandwidth_bps": bps}
            prog.start(net)
            try:
                if net == "loopback":
                    cmd = launcher_prefix(workers, "mpirun", ENV_NAMES) + argv_for(net)
                    env = job_env()
                    info["transport"] = "Open MPI shared memory (vader), localhost"
                else:
                    if tb is None:
                        tb = Testbed(workers, ranks_per_node=ranks_per_node).setup()
                        res["namespaces"] = tb.namespaces()
                    tb.set_rate(bps)
                    info["transport"] = ("TCP over veth + bridge, each rank in its own netns"
                                         if ranks_per_node == 1 else
                                         f"TCP over veth + bridge between nodes of "
                                         f"{ranks_per_node} ranks, one netns per node")
                    info["link_measured_mbit"] = tb.measure_link()
                    cmd = tb.mpirun_cmd(argv_for(net))
                    env = tb.env()
                info["command"] = shlex.join(cmd)
                t0 = time.perf_counter()
                rs = run_job(cmd, env, timeout, prog.update)
                info["wall_s"] = time.perf_counter() - t0
            except (JobError, RuntimeError, PermissionError, OSError) as e:
                res["errors"].append({"network": net, "error": str(e)[-3000:]})
                prog.end(f"FAILED: {str(e).splitlines()[0][:100]}")
                continue
            eff = bps or (1e6 * info["link_measured_mbit"] if net == "unlimited" else None)
            for r in rs:
                r["network"], r["bandwidth_bps"], r["effective_bps"] = net, bps, eff
                r["transfer_model_s"] = (r["wire_bits_per_step"] / eff) if eff else 0.0
            res["runs"].extend(rs)
            res["networks"].append(info)
            d = next((r for r in rs if r["method"] == "none"), None)
            s = next((r for r in rs if r["method"] == "sbc"), None)
            msg = f"link {info.get('link_measured_mbit', float('nan')):.0f} Mbit/s" \
                if "link_measured_mbit" in info else "shared memory"
            if d and s:
                msg += (f"; dense {1000 * d['step_time_s']:.0f} ms, {s['label']} "
                        f"{1000 * s['step_time_s']:.0f} ms per step")
            prog.end(msg)
    finally:
        if tb is not None:
            tb.teardown()
    res["crossover"] = analyse(res["runs"])
    return res


def print_net(res: Dict[str, object]) -> None:
    runs = res["runs"]
    nets = [n["network"] for n in res["networks"]]
    labels = []
    for r in runs:
        if r["label"] not in labels:
            labels.append(r["label"])
    cell = {(r["label"], r["network"]): r for r in runs}
    params = runs[0]["params"] if runs else 0
    print(f"\nstep time (ms) per network, {params:,}-parameter MLP, {res['workers']} ranks")
    print(f"{'method':<18}{'Mbit/step':>10}" + "".join(f"{n:>12}" for n in nets))
    for lab in labels:
        r0 = next(r for r in runs if r["label"] == lab)
        row = f"{lab:<18}{r0['wire_bits_per_step'] / 1e6:>10.3f}"
        for n in nets:
            r = cell.get((lab, n))
            row += f"{1000 * r['step_time_s']:>12.1f}" if r else f"{'-':>12}"
        print(row)
    meas = [f"{n['network']}: {n['link_measured_mbit']:.0f} Mbit/s" for n in res["networks"]
            if "link_measured_mbit" in n]
    if meas:
        print("measured TCP throughput: " + ", ".join(meas))
    cx = res.get("crossover", {})
    print("\ncrossover vs dense allreduce (method faster below this bandwidth):")
    for lab, e in cx.items():
        if not isinstance(e, dict) or lab == "none":
            continue
        ratios = ", ".join(f"{k} {v:.3g}" for k, v in e.get("step_time_over_dense", {}).items())
        print(f"  {lab:<16} fit: {e.get('from_fit', '-'):<24} fast link + bits: "
              f"{e.get('from_fast_link', '-'):<24} loopback + bits: {e.get('from_loopback', '-')}")
        print(f"  {'':<16} step time / dense: {ratios}")
    for e in res.get("errors", []):
        print(f"error at {e['network']}: {e['error'].splitlines()[0]}")


def plot_net(res: Dict[str, object], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = res["runs"]
    if not runs:
        return
    eff = {r["network"]: r.get("effective_bps") or r.get("bandwidth_bps") for r in runs}
    xs_known = sorted({b for b in eff.values() if b})
    top = max(xs_known) if xs_known else 1e9
    x_loop = top * 10
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    labels = []
    for r in runs:
        if r["label"] not in labels:
            labels.append(r["label"])
    cross = res.get("crossover", {})
    for lab in labels:
        rs = [r for r in runs if r["label"] == lab]
        if lab == "local":  # compute only: a floor for every method
            ax.axhline(rs[0]["step_time_s"], ls="--", c="gray", lw=1,
                       label="compute only (no communication, loopback)")
            continue
        pts = sorted((eff[r["network"]], r["step_time_s"]) for r in rs if eff[r["network"]])
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=lab)
        loop = [r["step_time_s"] for r in rs if r["network"] == "loopback"]
        if loop:
            ax.plot([x_loop], loop, "s", color=line.get_color())
        fit = (cross.get(lab) or {}).get("fit")
        if fit and len(xs_known) > 1:
            lo, hi = xs_known[0], xs_known[-1]
            xs = [lo * (hi / lo) ** (i / 60) for i in range(61)]
            ys = [fit["a_s"] + fit["c_bits"] / x for x in xs]
            ax.plot([x for x, y in zip(xs, ys) if y > 0], [y for y in ys if y > 0], ":", lw=0.8,
                    color=line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks, names = [], []
    for net, b in sorted(((n, b) for n, b in eff.items() if b), key=lambda t: t[1]):
        ticks.append(b)
        v = f"{b / 1e9:.3g} Gbit/s" if b >= 1e9 else f"{b / 1e6:.3g} Mbit/s"
        names.append(v if net != "unlimited" else f"veth, no tc\n({v} measured)")
    if "loopback" in eff:
        ticks.append(x_loop)
        names.append("loopback\n(shared mem.)")
    ax.set_xticks(ticks)
    ax.set_xticklabels(names, fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("link bandwidth per rank, each direction (tc tbf on every veth)")
    ax.set_ylabel("step time (s, log)")
    p = runs[0]["params"]
    ax.set_title(f"step time vs bandwidth: {p / 1e6:.1f}M-parameter MLP, {res['workers']} ranks "
                 "(dotted: fit t = a + c/B)", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_net(res: Dict[str, object]) -> str:
    runs = res["runs"]
    nets = [n["network"] for n in res["networks"]]
    labels = []
    for r in runs:
        if r["label"] not in labels:
            labels.append(r["label"])
    cell = {(r["label"], r["network"]): r for r in runs}
    lines = ["| method | Mbit sent / step / rank | " + " | ".join(nets) + " |",
             "|---|---:|" + "---:|" * len(nets)]
    for lab in labels:
        r0 = next(r for r in runs if r["label"] == lab)
        row = [f"{1000 * cell[(lab, n)]['step_time_s']:.1f} ms" if (lab, n) in cell else "-"
               for n in nets]
        lines.append(f"| {lab} | {r0['wire_bits_per_step'] / 1e6:.3f} | " + " | ".join(row) + " |")
    cx = res.get("crossover", {})
    lines += ["", "| method | step time ÷ dense | crossover (fit) | crossover (fast link + bits) "
              "| crossover (loopback + bits) |", "|---|---|---|---|---|"]
    for lab, e in cx.items():
        if not isinstance(e, dict) or lab == "none":
            continue
        ratios = ", ".join(f"{k}: {v:.3g}" for k, v in e.get("step_time_over_dense", {}).items())
        lines.append(f"| {lab} | {ratios} | {e.get('from_fit', '-')} | "
                     f"{e.get('from_fast_link', '-')} | {e.get('from_loopback', '-')} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# the topologies side by side: allgather vs sparse reduce-scatter
# ------------------------------------------------------------------------------------------------
TOPOLOGY_METHODS = [
    {"method": "local"},
    {"method": "none"},
    {"method": "sbc", "density": 0.01},
    {"method": "sbc", "density": 0.01, "topology": "reduce_scatter"},
    {"method": "sbc", "density": 0.01, "api": "stock"},
    {"method": "sbc", "density": 0.01, "api": "stock", "topology": "reduce_scatter"},
]


def topology_pairs(methods: Sequence[dict]) -> List[tuple]:
    """(allgather label, reduce-scatter label) of every reduce-scatter method entry whose
    allgather twin (the same entry without ``topology``) is among ``methods``."""
    labels = {method_label(m) for m in methods}
    out = []
    for m in methods:
        if m.get("topology") == "reduce_scatter":
            twin = {k: v for k, v in m.items() if k != "topology"}
            if method_label(twin) in labels:
                out.append((method_label(twin), method_label(m)))
    return out


def topology_rows(by_workers: Dict[str, Dict[str, object]],
                  methods: Sequence[dict]) -> List[dict]:
    """One row per (ranks, network, method) of :func:`run_topology`'s runs: step time, its ratio
    to dense allreduce on the same network, bits per rank per step (the compressors' from
    ``stats()``, mean over ranks; dense and fp16: what a rank receives in the ring allreduce,
    2(N-1)/N of the model), decode time per step, and for a reduce-scatter method its ratios to
    the allgather twin (step, bits down, decode)."""
    pairs = dict((rs, ag) for ag, rs in topology_pairs(methods))
    rows = []
    for w in sorted(by_workers, key=int):
        runs = by_workers[w]["runs"]
        cell = {(r["network"], r["label"]): r for r in runs}
        for r in runs:
            dense = cell.get((r["network"], "none"))
            row = {"workers": int(w), "network": r["network"], "label": r["label"],
                   "method": r["method"], "topology": r.get("topology"),
                   "api": r.get("api", "drop-in"), "steps": r["steps"],
                   "step_time_s": r["step_time_s"],
                   "step_over_dense": (r["step_time_s"] / dense["step_time_s"]) if dense else None,
                   "upstream_bits_per_step": r["upstream_bits_per_step"],
                   "downstream_bits_per_step": (r["wire_bits_per_step"]
                                                if r["method"] in ("none", "fp16")
                                                else r["downstream_bits_per_step"]),
                   "decode_s_per_step": r.get("decode_s_per_step", 0.0)}
            ag = cell.get((r["network"], pairs.get(r["label"])))
            if ag is not None:
                def ratio(k, a=ag, b=r):
                    return b[k] / a[k] if a.get(k) else None
                row["rs_over_allgather"] = {
                    "step_time": ratio("step_time_s"),
                    "downstream_bits": ratio("downstream_bits_per_step"),
                    "decode": ratio("decode_s_per_step")}
            rows.append(row)
    return rows


def run_topology(workers: Sequence[int] = (4, 8), bandwidths: Sequence[str] = ("1gbit", "100mbit"),
                 methods: Optional[List[dict]] = None, sizes: Optional[List[int]] = None,
                 rounds: int = 6, block: int = 1, loopback: bool = True, timeout: float = 1800,
                 progress: bool = True) -> Dict[str, object]:
    """:func:`run_net` per rank count with the methods in turns (``rounds`` rounds of ``block``
    steps each, median step: the ratios are measured side by side), then
    :func:`topology_rows`."""
    methods = list(methods or TOPOLOGY_METHODS)
    sizes = sizes or FULL_SIZES
    t0 = time.perf_counter()
    by = {}
    for w in workers:
        by[str(w)] = run_net(bandwidths, loopback=loopback, unlimited=False, workers=w,
                             methods=methods, sizes=sizes, timeout=timeout, progress=progress,
                             interleave={"rounds": rounds, "block": block})
    return {"config": {"workers": list(workers), "bandwidths": list(bandwidths),
                       "methods": methods, "sizes": sizes,
                       "interleave": {"rounds": rounds, "block": block}},
            "by_workers": by, "rows": topology_rows(by, methods),
            "errors": [dict(e, workers=int(w)) for w, r in by.items() for e in r["errors"]],
            "wall_s": time.perf_counter() - t0, "load_average": os.getloadavg()}


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{1000 * v:.1f}"


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown_topology(res: Dict[str, object]) -> str:
    """The rows of :func:`run_topology` as one markdown table (and the setup in a line)."""
    cfg = res["config"]
    params = next((r["params"] for b in res["by_workers"].values() for r in b["runs"]), 0)
    il = cfg["interleave"]
    lines = [f"{params:,}-parameter MLP {cfg['sizes']}, batch 32 per rank, every rank in its own "
             f"network namespace behind a tc-shaped veth (loopback: plain localhost, shared "
             f"memory); methods in turns, {il['rounds']} rounds of {il['block']} step(s) each, "
             f"median step. RS ÷ AG: the reduce-scatter over the same method with the "
             f"allgather (step time / Mbit down / decode).", "",
             "| ranks | network | method | step | ÷ dense | Mbit down / rank / step "
             "| decode / step | RS ÷ AG (step / bits / decode) |",
             "|---:|---|---|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        rs = r.get("rs_over_allgather")
        rs_s = " / ".join(_x(rs[k]) for k in ("step_time", "downstream_bits", "decode")) \
            if rs else ""
        comp = r["method"] not in ("local", "none")
        lines.append(f"| {r['workers']} | {r['network']} | {r['label']} | "
                     f"{_ms(r['step_time_s'])} ms | {_x(r['step_over_dense'])} | "
                     f"{r['downstream_bits_per_step'] / 1e6:.3f} | "
                     f"{_ms(r['decode_s_per_step']) + ' ms' if comp else '-'} | {rs_s} |")
    return "\n".join(lines)


def plot_topology(res: Dict[str, object], path: str) -> None:
    """Step time per (ranks, network), one bar per method (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in res["rows"] if r["method"] != "local"]
    cells = []
    for r in rows:
        if (r["workers"], r["network"]) not in cells:
            cells.append((r["workers"], r["network"]))
    labels = []
    for r in rows:
        if r["label"] not in labels:
            labels.append(r["label"])
    val = {(r["workers"], r["network"], r["label"]): r["step_time_s"] for r in rows}
    fig, ax = plt.subplots(figsize=(9, 4.8))
    wbar = 0.8 / max(1, len(labels))
    for j, lab in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * wbar for i in range(len(cells))]
        ax.bar(xs, [val.get((w, n, lab), 0.0) for w, n in cells], wbar, label=lab)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{w} ranks\n{n}" for w, n in cells], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("step time (s, log)")
    ax.set_title("SBC p=0.01: allgather vs sparse reduce-scatter on the network testbed",
                 fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def topology_parser():
    import argparse
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_net topology",
        description="SBC's allgather vs reduce-scatter topology on the network testbed (root)")
    ap.add_argument("--workers", type=int, action="append", help="rank count, repeatable (4, 8)")
    ap.add_argument("--bandwidth", action="append", help="tc rate, repeatable (1gbit, 100mbit)")
    ap.add_argument("--sizes", help="MLP layer sizes (default the testbed's "
                                    f"{','.join(map(str, FULL_SIZES))})")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=1)
    ap.add_argument("--no-stock", action="store_true", help="without the stock-hook methods")
    ap.add_argument("--no-loopback", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", help="results; the table beside it (.md) and a plot (.png)")
    ap.add_argument("--reanalyse", metavar="JSON",
                    help="no run: the rows, table and plot again from a JSON this wrote")
    return ap


def topology_methods(args) -> List[dict]:
    ms = [dict(m) for m in TOPOLOGY_METHODS if not (args.no_stock and m.get("api") == "stock")]
    for m in ms:
        if "density" in m:
            m["density"] = args.density
    return ms


def topology_main(argv: Sequence[str]) -> int:
    args = topology_parser().parse_args(list(argv))
    if args.reanalyse:
        with open(args.reanalyse) as f:
            res = json.load(f)
        res["rows"] = topology_rows(res["by_workers"], res["config"]["methods"])
        args.json = args.json or args.reanalyse
        return _write_topology(res, args.json)
    res = run_topology(args.workers or [4, 8], args.bandwidth or ["1gbit", "100mbit"],
                       methods=topology_methods(args),
                       sizes=[int(x) for x in args.sizes.split(",")] if args.sizes else None,
                       rounds=args.rounds, block=args.block, loopback=not args.no_loopback,
                       progress=not args.no_progress)
    res["command"] = "python -m benchmarks.bench_net topology " + shlex.join(list(argv))
    return _write_topology(res, args.json)


def _write_topology(res: Dict[str, object], path: Optional[str]) -> int:
    md = markdown_topology(res)
    print(md)
    for e in res["errors"]:
        print(f"error at {e['workers']} ranks, {e['network']}: {e['error'].splitlines()[0]}")
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        stem = os.path.splitext(path)[0]
        notes = [f"Code: {res['code']}." if res.get("code") else "",
                 "Load average (1, 5, 15 min) at the end: "
                 + ", ".join(f"{x:.1f}" for x in res["load_average"])
                 if res.get("load_average") else ""]
        with open(stem + ".md", "w") as f:
            f.write(f"`{res['command']}`\n\n" + "".join(n + "\n\n" for n in notes if n)
                    + f"{md}\n")
        if res["rows"]:
            plot_topology(res, stem + ".png")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        sys.exit(worker_main(sys.argv[2:]))
    if len(sys.argv) >= 2 and sys.argv[1] == "topology":
        sys.exit(topology_main(sys.argv[2:]))
    print("usage: python -m benchmarks.bench net ... (this module's entries: worker, topology)")
    sys.exit(2)
