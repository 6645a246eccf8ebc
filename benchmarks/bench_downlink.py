"""Downlink benchmark (issue #6): allgather vs server-dense vs server-top-k for 2, 4, 8 ranks.

Each configuration is a real ``mpirun`` job of ``examples/pytorch_sbc_digits.py`` (scikit-learn
digits, SBC uplink at density 0.01, delay 4). It records, per worker (a non-root rank), the
downlink bits per sync and the final test accuracy. With allgather every worker downloads every
other worker's message, so its downlink grows linearly with the number of workers; with the
server topology and a top-k downlink it stays flat ("server-topk": the kept values; "server-sbc":
the downlink binarized like SBC, positions and one mean per tensor).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pytorch_sbc_digits.py"
CONFIGS = [("allgather", None), ("server-dense", None), ("server-topk", 0.02),
           ("server-sbc", 0.02)]


def _run(np_: int, topology: str, downlink: float, epochs: int, timeout: float) -> Dict:
    out = os.path.join(tempfile.mkdtemp(prefix="sbc-downlink-"), "res.json")
    from horovod_sbc import launch
    cmd = launch.launcher_prefix(np_, "mpirun") + [
        sys.executable, str(EXAMPLE), "--methods", "sbc", "--density", "0.01", "--delay", "4",
        "--epochs", str(epochs), "--no-progress", "--json", out,
        "--topology", "server" if topology.startswith("server") else "allgather"]
    if downlink is not None:
        cmd += ["--downlink-density", str(downlink)]
    if topology == "server-sbc":
        cmd.append("--downlink-binarize")
    t0 = time.monotonic()
    rc, output = launch.run(cmd, timeout)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{output[-6000:]}")
    (run,) = json.load(open(out))["runs"]
    worker = run["per_rank"][1]  # a worker that is not the server
    return {"topology": topology, "downlink_density": downlink, "workers": np_,
            "final_accuracy": run["final_accuracy"], "syncs": worker["syncs"],
            "downlink_bits_per_sync": worker["downstream_bits"] / worker["syncs"],
            "uplink_bits_per_sync": worker["upstream_bits"] / worker["syncs"],
            "root": run["per_rank"][0], "wall_s": time.monotonic() - t0,
            "command": " ".join(cmd)}


def run_downlink(sizes=(2, 4, 8), epochs: int = 20, timeout: float = 600,
                 progress=print) -> Dict:
    rows: List[Dict] = []
    for np_ in sizes:
        for topo, dd in CONFIGS:
            progress(f"[downlink] {topo:<13} {np_} ranks ...")
            r = _run(np_, topo, dd, epochs, timeout)
            rows.append(r)
            progress(f"[downlink] {topo:<13} {np_} ranks: downlink "
                     f"{r['downlink_bits_per_sync']:,.0f} bits/sync per worker, accuracy "
                     f"{100 * r['final_accuracy']:.2f}% ({r['wall_s']:.0f} s)")
    return {"runs": rows, "sizes": list(sizes), "epochs": epochs}


def print_table(res: Dict) -> None:
    print(f"\n{'topology':<14}{'workers':>8}{'downlink bits/sync':>20}{'uplink bits/sync':>18}"
          f"{'accuracy':>10}")
    for r in res["runs"]:
        print(f"{r['topology']:<14}{r['workers']:>8}{r['downlink_bits_per_sync']:>20,.0f}"
              f"{r['uplink_bits_per_sync']:>18,.0f}{100 * r['final_accuracy']:>9.2f}%")


def plot(res: Dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for topo, _ in CONFIGS:
        rows = [r for r in res["runs"] if r["topology"] == topo]
        ax.plot([r["workers"] for r in rows], [r["downlink_bits_per_sync"] for r in rows],
                marker="o", label=topo)
    ax.set_xlabel("workers")
    ax.set_ylabel("downlink bits per sync, per worker")
    ax.set_yscale("log")
    ax.set_xticks(res["sizes"])
    ax.set_title("Downlink traffic vs workers (digits MLP, SBC uplink p=0.01, n=4)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench downlink",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--plot", help="PNG path (default: next to --json)")
    args = ap.parse_args(argv)
    res = run_downlink(tuple(int(x) for x in args.sizes.split(",")), args.epochs)
    print_table(res)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        res["command"] = "python -m benchmarks.bench downlink " + " ".join(argv or sys.argv[1:])
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        png = args.plot or os.path.splitext(args.json)[0] + ".png"
        plot(res, png)
        print(f"wrote {args.json} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
