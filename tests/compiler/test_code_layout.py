"""The shape of the code base, checked on the CPU:

- no import cycle among the modules of ``k3compile/`` and ``patterns/``, counting every import (a cycle hidden by
  an import inside a function is still a cycle);
- no file in ``k3compile/`` over 400 lines unless it holds one kernel (one CuTe kernel class, or one launched
  ``@triton.jit`` kernel with its helpers and launcher);
- what ``ops.load_all()`` and every op's ``dispatch.py`` import runs without Triton, CuTe DSL and fla (they load
  where their kernels run);
- ``benchmarks/results/README.md`` indexes exactly the files in that folder.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = {"k3compile": "k3compile", "patterns": "k3compile.patterns"}   # folder -> the name it installs as
MAX_LINES = 400


def _modules() -> dict[str, str]:
    """Installed module name -> file, for every module of the packages above."""
    out = {}
    for folder, name in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, folder))[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join([name] + rel)] = os.path.join(dirpath, f)
    return out


def _imports(module: str, path: str, modules: dict) -> set[str]:
    """The modules of ``modules`` that ``module`` imports anywhere in its file."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            if name == "patterns" or name.startswith("patterns."):
                name = "k3compile." + name   # the folder's installed name
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _package_parents(module: str) -> set[str]:
    """The package ``__init__`` modules Python runs before ``module``: not edges of a cycle of ours."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) - _package_parents(m) for m, p in modules.items()}
    assert _cycles(graph) == []


def _kernels(path: str) -> int:
    """CuTe classes with a ``@cute.kernel`` method, and ``@triton.jit`` functions named ``*kernel``, in the file."""
    count = 0
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.ClassDef):
            count += any("cute.kernel" in ast.unparse(d) for f in node.body if isinstance(f, ast.FunctionDef)
                         for d in f.decorator_list)
        elif isinstance(node, ast.FunctionDef) and node.name.endswith("kernel"):
            count += any("triton.jit" in ast.unparse(d) for d in node.decorator_list)
    return count


def test_long_files_hold_one_kernel():
    long = {os.path.relpath(p, ROOT): n for m, p in _modules().items() if m.startswith("k3compile.")
            and not m.startswith("k3compile.patterns") and (n := len(open(p).read().splitlines())) > MAX_LINES}
    assert {f: n for f, n in long.items() if _kernels(os.path.join(ROOT, f)) != 1} == {}


_WITHOUT_KERNEL_PACKAGES = """
import importlib, sys
for name in ("triton", "cutlass", "fla"):
    sys.modules[name] = None   # importing them now fails
import k3compile, k3compile.ops
for op in k3compile.ops.load_all():
    importlib.import_module(f"k3compile.ops.{op}.dispatch") if op != "all_reduce" else None
import k3compile.patterns
print("ok")
"""


def test_ops_and_dispatch_import_without_triton_cute_or_fla():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _WITHOUT_KERNEL_PACKAGES], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def _index_names(cell: str) -> set[str]:
    """The file names a row's first cell gives: ``a.{log,json}``, ``a_{x,y}_b.json`` and plain names."""
    import itertools
    import re

    names = set()
    for text in re.findall(r"`([^`]+)`", cell):
        parts = re.split(r"\{([^}]*)\}", text)   # literal, choices, literal, ...
        choices = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
        names.update("".join(c) for c in itertools.product(*choices))
    return names


def test_the_results_index_names_exactly_the_files_in_results():
    folder = os.path.join(ROOT, "benchmarks", "results")
    rows = [line for line in open(os.path.join(folder, "README.md")).read().splitlines() if line.startswith("| `")]
    named = set().union(*(_index_names(row.split("|")[1]) for row in rows))
    present = set(os.listdir(folder)) - {"README.md"}
    assert named - present == set(), "the index names files that are not there"
    assert present - named == set(), "files in benchmarks/results/ without a row in its README.md"
