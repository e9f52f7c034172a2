"""The package's layers import one direction, with no cycles (lazy imports inside functions
count): env/ -> core -> modules -> algorithms -> runner/config -> tools.

A module may import its own layer or any layer below it, never one above; and no set of
modules imports itself round a cycle, whatever the layers. Every project module must be placed
in a layer here (a new module fails until it is), and there is no exception list.
"""
import ast
import os

from tests.conftest import ROOT

# The layers, lowest first; a module is placed by its longest matching prefix.
LAYERS = [
    ("env", ["env"]),
    ("core", ["agents.core", "agents.models", "agents.model_edits", "agents.samplers", "agents", "agents.modules.kv_cache",
              "agents.modules.prefill_store"]),
    ("modules", ["agents.modules", "agents.guides"]),
    ("algorithms", ["agents.algorithms", "agents.weight_sync"]),
    ("runner/config", ["agents.env_runner", "agents.runner_episodes", "agents.rollout_state", "agents.config", "agents.schema",
                       "agents.pbt"]),
    ("tools", ["agents.cli", "agents.train", "agents.curves", "agents.progress", "agents.resume", "agents.workarounds", "agents.experiment_store", "agents.trial_checkpoints", "agents.driver_lock",
               "agents.summary",
               "agents.evaluate", "agents.eval_report", "agents.generate",
               "agents.serve", "agents.export", "agents.pretrain", "agents.demo", "agents.reaper"]),
]


def project_modules() -> dict:
    """Dotted module name -> file, for every .py under agents/ and env/."""
    out = {}
    for top in ("agents", "env"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def _resolve(name: str, modules: dict) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(modules: dict) -> dict:
    """Module -> the project modules it imports anywhere in its file (top level or in a function)."""
    graph = {}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                dep = _resolve(target, modules)
                # `from agents.x import y` also names the package `agents`: only the deepest counts
                if dep and dep != name and not any(t != target and _resolve(t, modules) != dep
                                                   and _resolve(t, modules) and
                                                   _resolve(t, modules).startswith(dep + ".")
                                                   for t in targets):
                    deps.add(dep)
        graph[name] = deps
    return graph


def layer_of(name: str) -> int:
    best, where = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), index
    return where


def test_every_module_has_a_layer():
    unplaced = [m for m in project_modules() if layer_of(m) is None]
    assert not unplaced, f"place these modules in a layer (tests/test_layers.py LAYERS): {unplaced}"


def test_no_module_imports_a_layer_above_its_own():
    graph = imports(project_modules())
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
                    for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def cycles(graph: dict) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(imports(project_modules()))
    assert not found, f"import cycles: {found}"


def test_the_checks_can_fail():
    """The checker sees an upward import and a cycle when there is one (on a made-up graph)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("agents.train") > layer_of("agents.algorithms.ppo") > layer_of("agents.modules.actor_critic")
    assert layer_of("agents.modules.kv_cache") < layer_of("agents.modules.actor_critic")
    graph = imports(project_modules())
    assert "agents.algorithms.ppo" in graph["agents.algorithms.a3c"]  # imports are read, lazy ones too
    assert "agents.guides" in graph["agents.modules.acting"]  # a lazy import, inside a method


def test_files_and_classes_stay_readable():
    """No module of agents/ or env/ over 500 lines, no class over 200, and each algorithm's own
    module (agents/algorithms/__init__.py MODULES) readable on one screen: at most 250 lines."""
    from agents.algorithms import MODULES

    modules = project_modules()
    lines = {name: len(open(path).read().splitlines()) for name, path in modules.items()}
    assert not {n: k for n, k in lines.items() if k > 500}
    assert not {n: lines[n] for n in MODULES if lines[n] > 250}
    long_classes = {f"{name}.{node.name}": node.end_lineno - node.lineno + 1
                    for name, path in modules.items() for node in ast.walk(ast.parse(open(path).read()))
                    if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200}
    assert not long_classes
