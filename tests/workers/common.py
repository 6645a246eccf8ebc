"""Helpers for worker scripts: each worker gets its output directory as argv[1]."""
import json
import os
import sys


def write_result(rank, result):
    out = sys.argv[1]
    tmp = os.path.join(out, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))
