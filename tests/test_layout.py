"""The package's shape: no import cycle, small files and classes, and layers that never refer to their cache."""

import ast
import gc
from pathlib import Path

import pytest
import torch

import flexicache_hf
from conftest import tiny_config
from flexicache_hf import FlexiCache, HeadProfile

PACKAGE = Path(flexicache_hf.__file__).parent
TOOLING = ("bench", "eval", "stability")  # the benchmarks, the accuracy harness, the offline profiler


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Every package module -> the package modules it imports anywhere (inside functions too)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {m: set() for m in modules}
    for m, path in modules.items():
        package = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges[m] |= {t for t in targets if t in modules and t != m}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(imports()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_core_files_and_classes_stay_small():
    big = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in TOOLING:
            continue
        text = path.read_text()
        if len(text.splitlines()) > 450:
            big.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                big.append(f"{rel}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert big == []


def test_the_layer_package_never_imports_the_cache():
    layer_modules = [m for m in imports() if m.startswith("flexicache_hf.layer")]
    edges = imports()
    assert not any("flexicache_hf.cache" in edges[m] for m in layer_modules)


def reachable(start, limit: int = 20000) -> list:
    """Objects reachable from ``start`` through the package's own objects and plain containers."""
    seen, todo, out = set(), [start], []
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        out.append(obj)
        if isinstance(obj, (dict, list, tuple, set)) or type(obj).__module__.startswith("flexicache_hf"):
            todo.extend(gc.get_referents(obj))
    return out


def test_layers_hold_no_reference_to_their_cache():
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2)
    cache = FlexiCache(HeadProfile.random(cfg, 0.5, seed=1), page_size=4, token_budget=8, rerank_interval=2)
    for step, T in enumerate((9, 1, 1)):
        for i in range(2):
            handle, _ = cache.update(torch.randn(1, 2, T, 16), torch.randn(1, 2, T, 16), i)
            cache.attend(handle, torch.randn(1, 4, T, 16), None, 0.25)
    assert cache.get_seq_length() == 11
    for layer in cache.layers:
        assert layer.is_initialized
        assert not any(obj is cache for obj in reachable(layer))
    assert any(obj is cache.layers[0] for obj in reachable(cache))  # (the walk does find what is there)


def test_the_observer_is_fixed_when_the_cache_is_made():
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2)
    cache = FlexiCache(HeadProfile.random(cfg, 0.5, seed=1))
    with pytest.raises(AttributeError, match="observer=..."):
        cache.observer = object()
    assert cache.observer is None and all(layer.spec.observer is None for layer in cache.layers)
