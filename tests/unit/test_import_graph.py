"""The package's import graph: no cycle (lazy imports inside functions included), layers only import down, and
``algo/`` imports nothing of the package but itself.

The graph is read from the source (every ``import`` statement, at any depth), so an import hidden inside a
function to dodge a cycle at import time still counts.
"""

import ast
import sys
from pathlib import Path

import miles_ray

SRC = Path(miles_ray.__file__).resolve().parent

# Layers, bottom first: a module may import its own layer and the ones below, never one above.
LAYERS = [
    {"types", "config", "callables", "contracts", "deprecation", "devices", "metrics", "algo", "sync", "placement"}
    | {"state_codec", "keys", "lazy", "grafana"},
    {"models", "rewards", "data", "trackers"},
    {"engines", "backends", "hooks", "rollout", "multiturn", "evaluation"},
    {"actors"},
    # "" is the package itself (miles_ray/__init__.py)
    {"stack", "checkpoint", "fault", "health", "report", "eval", ""},
]


def module_names(root: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("miles_ray", *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file (``from a import b`` is ``a.b`` if a module)."""
    modules = module_names(root)
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                deps |= subs or {node.module}
                if len(subs) < len(node.names):  # some names are attributes of the module itself
                    deps.add(node.module)
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int:
    top = module.removeprefix("miles_ray").lstrip(".").split(".")[0]
    found = [i for i, names in enumerate(LAYERS) if top in names]
    assert found, f"{module} is in no layer: add {top!r} to LAYERS"
    return found[0]


def is_package_init(importer: str, imported: str) -> bool:
    """A package's ``__init__`` re-exporting its own submodules (``miles_ray.actors`` -> ``miles_ray.actors.x``)."""
    return imported.startswith(importer + ".")


def test_the_cycle_finder_finds_a_cycle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "miles_ray.backends.rl_step" in graph
    assert cycles(graph) == []


def test_every_module_is_in_a_layer_and_imports_only_down():
    graph = import_graph()
    up = [
        f"{importer} (layer {layer(importer)}) -> {imported} (layer {layer(imported)})"
        for importer, deps in graph.items()
        for imported in deps
        if layer(imported) > layer(importer) and not is_package_init(importer, imported)
    ]
    assert up == []


def test_algo_imports_only_torch_and_itself():
    algo = {name: path for name, path in module_names().items() if name.startswith("miles_ray.algo")}
    outside = {
        f"{name} imports {dep}" for name in algo for dep in import_graph()[name] if not dep.startswith("miles_ray.algo")
    }
    assert outside == set()
    allowed = {"torch", "miles_ray", "__future__"} | set(sys.stdlib_module_names)
    for name, path in algo.items():  # and of third-party code, torch alone
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                roots = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert all(r.split(".")[0] in allowed for r in roots), f"{name} imports {roots}"
