"""Architecture figures of the library (pipeline/, shardformer/, booster_plugin/), for the notes of refactoring work:

- import cycles among the library's modules: strongly connected groups of the import graph, with the edges that
  importing a module's parent packages adds (except packages that contain the importer, which a package's
  re-exports of its own modules would otherwise close); `function-level` counts the cycles closed only by an import
  inside a function (a loop hidden from the module graph),
- files and lines per folder, files over 400 lines, uses of `Any`, `getattr`/`setattr`/`hasattr` calls.

    python benchmarks/architecture.py [--json out.json]
"""
from __future__ import annotations

import argparse
import ast
import json
import os
from collections import Counter, defaultdict
from typing import Dict, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pipeline", "shardformer", "booster_plugin")


def _modules() -> Dict[str, str]:
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return found


def _imports(module: str, path: str, modules: Dict[str, str]) -> List[Tuple[str, bool]]:
    """(imported library module, inside a function) for each import of `module`."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            target = name
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                out.append((target, id(node) in inner))
    return out


def _with_parents(target: str, modules: Dict[str, str]) -> List[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first."""
    parts = target.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules]


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in list(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        group.append(top)
                        if top == node:
                            break
                    if len(group) > 1:
                        out.append(sorted(group))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]
                counter[0] += 1
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(sorted(edges.get(nxt, ())))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return out


def figures() -> Dict[str, object]:
    modules = _modules()
    top: Dict[str, Set[str]] = defaultdict(set)
    every: Dict[str, Set[str]] = defaultdict(set)
    for module, path in modules.items():
        for target, in_function in _imports(module, path, modules):
            for reached in _with_parents(target, modules):
                # a package containing this module is being imported already: not a new edge
                if reached != module and not module.startswith(reached + "."):
                    every[module].add(reached)
                    if not in_function:
                        top[module].add(reached)
    all_cycles, top_cycles = _cycles(every), _cycles(top)
    hidden = [c for c in all_cycles if not any(set(c) <= set(t) for t in top_cycles)]
    per_folder, lines, big = Counter(), Counter(), []
    any_uses = attr_calls = 0
    for module, path in modules.items():
        text = open(path).read()
        folder = os.path.dirname(os.path.relpath(path, ROOT))
        per_folder[folder] += 1
        n = text.count("\n")
        lines[folder] += n
        if n > 400:
            big.append(f"{os.path.relpath(path, ROOT)} ({n})")
        tree = ast.parse(text)
        any_uses += sum(isinstance(x, ast.Name) and x.id == "Any" for x in ast.walk(tree))
        attr_calls += sum(isinstance(x, ast.Call) and isinstance(x.func, ast.Name) and
                          x.func.id in ("getattr", "setattr", "hasattr") for x in ast.walk(tree))
    return {"modules": len(modules), "cycles_module_level": top_cycles, "cycles_function_level": hidden,
            "files_per_folder": dict(sorted(per_folder.items())), "lines_per_folder": dict(sorted(lines.items())),
            "files_over_400_lines": big, "any_uses": any_uses, "getattr_setattr_hasattr_calls": attr_calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    result = figures()
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:40s} {v}")
        elif isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"  {item}")
        else:
            print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
