"""The results table the examples print on rank 0 (and their ``--json`` file)."""
from __future__ import annotations

import json
from typing import Dict, List, Optional


def print_runs(results: List[Dict], json_path: Optional[str] = None) -> None:
    """One line per run: method, api, density, delay, accuracy, compression ratio, mean step
    time and whether all ranks ended bit-identical; the SBC ÷ dense step time for a pair."""
    w = max([9] + [len(r["api"]) + 2 for r in results])
    print(f"\n{'method':<7}{'api':<{w}}{'density':>8}{'delay':>6}{'accuracy':>10}"
          f"{'ratio':>10}{'step ms':>9}  ranks identical")
    for r in results:
        print(f"{r['method']:<7}{r['api']:<{w}}{r['density']:>8g}{r['delay']:>6}"
              f"{100 * r['final_accuracy']:>9.2f}%{r['compression_ratio']:>9.0f}x"
              f"{1000 * r['step_time_s']:>9.2f}  {r['ranks_identical']}")
    if len(results) == 2:
        print(f"SBC step time / dense step time: "
              f"{results[1]['step_time_s'] / results[0]['step_time_s']:.2f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"runs": results}, f, indent=1)
