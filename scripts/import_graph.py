"""The import graph of the horovod_sbc package, and its two rules: no circles, no upward import.

    python scripts/import_graph.py            # the graph, layer by layer; exit 1 on a violation
    python scripts/import_graph.py --dot FILE # also write it as Graphviz dot

Every import counts — at module level, inside functions and under ``TYPE_CHECKING`` — because
each one is a dependency a reader must follow. Modules are assigned to the layers of
``ARCHITECTURE.md`` (``LAYERS`` below); a module may import only from its own layer or lower ones,
and the graph must have no cycle.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "horovod_sbc"

#: layer of each module (prefix match, longest wins), lowest first
LAYERS = [
    ("format", ["wire", "crc", "registry", "config", "policy", "residual", "launch", "regions",
                "mpi", "outer", "hierarchy"]),
    ("protocol", ["protocol"]),
    ("reference", ["reference"]),
    ("kernels", ["kernels"]),
    ("backends", ["torch.backend", "tensorflow.backend"]),
    ("compressors", ["compressors"]),
    ("sync", ["torch.sync", "tensorflow.sync"]),
    ("integrations", ["torch", "tensorflow", "advise"]),
    ("package", [""]),
]


def modules() -> Dict[str, Path]:
    out = {}
    for p in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = p.relative_to(ROOT / PACKAGE).with_suffix("")
        parts = [x for x in rel.parts if x != "__init__"]
        out[".".join(parts)] = p
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> List[str]:
    base = mod.split(".") if mod else []
    if not is_pkg:
        base = base[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        target = base + (node.module.split(".") if node.module else [])
    elif node.module and node.module.split(".")[0] == PACKAGE:
        target = node.module.split(".")[1:]
    else:
        return []
    t = ".".join(target)
    return [t + "." + a.name if t else a.name for a in node.names]


def imports(mods: Dict[str, Path]) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            names: List[str] = []
            if isinstance(node, ast.ImportFrom):
                names = _resolve(m, p.name == "__init__.py", node)
            elif isinstance(node, ast.Import):
                names = [a.name.split(".", 1)[1] for a in node.names
                         if a.name.startswith(PACKAGE + ".")]
            for n in names:
                # "from . import codec" names a module; "from .codec import x" names its module
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != m:
                    graph[m].add(n)
    return graph


def layer_of(mod: str) -> int:
    best, best_len = len(LAYERS) - 1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".") or pre == "") and len(pre) > best_len:
                best, best_len = i, len(pre)
    return best


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(graph: Dict[str, Set[str]]) -> List[str]:
    return [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
            for a in sorted(graph) for b in sorted(graph[a]) if layer_of(b) > layer_of(a)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dot", help="write the graph as Graphviz dot to this file")
    args = ap.parse_args(argv)
    graph = imports(modules())
    for i, (name, _) in enumerate(LAYERS):
        members = [m for m in sorted(graph) if layer_of(m) == i]
        if members:
            print(f"{i} {name}:")
            for m in members:
                deps = ", ".join(sorted(graph[m])) or "-"
                print(f"    {PACKAGE}.{m or '__init__'} -> {deps}")
    bad = [f"circle: {' <-> '.join(c)}" for c in cycles(graph)] + [
        f"upward: {u}" for u in upward(graph)]
    if args.dot:
        lines = ["digraph horovod_sbc {", "  rankdir=BT;"]
        lines += [f'  "{a or PACKAGE}" -> "{b or PACKAGE}";' for a in sorted(graph)
                  for b in sorted(graph[a])]
        Path(args.dot).write_text("\n".join(lines + ["}"]) + "\n")
    for b in bad:
        print(b)
    print("no circles, no upward imports" if not bad else f"{len(bad)} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
