"""The packages stand in layers and import only downward, with no circle (as farm-studio draws them).

engine (model, decode decisions, scheduler, KV, runners) < serving (request contract, keys, loop,
metrics) and train (data, training, evaluation) < ops (launcher, gateway, watchdog) < the tools
(builder, client, the Triton adapters) < benchmarks.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {  # package prefix -> (height, packages of the same height it may not import)
    "dualend.engine": 0,
    "dualend.serving": 1,
    "dualend.train": 1,
    "dualend.ops": 2,
    "builder": 3,
    "client": 3,
    "model_repository": 3,
    "benchmarks": 4,
}


def layer_of(module: str) -> str | None:
    return next((p for p in sorted(LAYERS, key=len, reverse=True) if module == p or module.startswith(p + ".")), None)


def project_imports() -> dict[str, set[str]]:
    """{module: the project modules it imports}, relative imports resolved."""
    graph = {}
    for path in ROOT.glob("**/*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv", "build") or rel.parts[0].startswith("."):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                found.add(base)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[module] = {m for m in found if layer_of(m) is not None}
    return graph


def test_every_import_runs_down_a_layer_or_stays_in_its_package():
    upward = []
    for module, imported in project_imports().items():
        own = layer_of(module)
        if own is None:
            continue
        for target in imported:
            other = layer_of(target)
            if other != own and LAYERS[other] >= LAYERS[own]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run up or sideways between layers:\n" + "\n".join(sorted(upward))


def test_no_module_imports_itself_through_a_circle():
    graph = project_imports()
    modules = {m: {t for t in targets if t in graph} for m, targets in graph.items()}
    visiting, done, circles = set(), set(), []

    def visit(module, path):
        if module in visiting:
            circles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        visiting.add(module)
        for target in modules[module]:
            visit(target, path + [module])
        visiting.discard(module)
        done.add(module)

    for module in modules:
        visit(module, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_check_sees_an_upward_import():
    assert layer_of("dualend.engine.decode") == "dualend.engine"
    assert LAYERS[layer_of("dualend.ops.launch")] > LAYERS[layer_of("dualend.serving.loop")]
    graph = project_imports()
    assert "dualend.engine.decode" in graph["dualend.serving.loop"]  # relative and absolute imports both read
