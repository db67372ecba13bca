"""The house rules of docs/architecture.md ("Layers"), checked on the source: imports go one
way, from a higher layer to a lower one, and no module imports itself back through others.

The import graph is read with `ast` from every module of the package (imports inside functions
and under TYPE_CHECKING included: each still ties one module to another). `KNOWN_VIOLATIONS`
lists the edges that break the rules today; it may only shrink: an edge that no longer exists
must leave the list, and any new violation fails.

Every module is also imported alone in a fresh interpreter, which is how a circular import
shows at run time (an ImportError for a partly initialised module).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdproxy.compiled import compiled_modules

PACKAGE = Path(__file__).resolve().parents[2] / "pdproxy"

# Layers, lowest first; a module's layer is that of the longest prefix that names it.
BASE, CORE, INFRASTRUCTURE, APPLICATION, PROCESSES, CLI = range(6)
LAYERS: dict[str, int] = {
    "pdproxy": BASE,  # the package itself: its version, nothing else
    "pdproxy.compiled": BASE,
    "pdproxy.base": BASE,
    "pdproxy.ids": CORE,
    "pdproxy.registry.messages": CORE,
    "pdproxy.registry.auth": CORE,
    "pdproxy.registry.table": CORE,
    "pdproxy.registry.kv_stats": CORE,
    "pdproxy.registry.pods": CORE,
    "pdproxy.pairing": CORE,
    "pdproxy.reliability": CORE,
    "pdproxy.http": INFRASTRUCTURE,
    "pdproxy.tracing": INFRASTRUCTURE,
    "pdproxy.config": APPLICATION,
    "pdproxy.logs": APPLICATION,
    "pdproxy.metrics": APPLICATION,
    "pdproxy.local_metrics": APPLICATION,
    "pdproxy.registry": APPLICATION,
    "pdproxy.proxy": APPLICATION,
    "pdproxy.vllm_side": APPLICATION,  # beside the proxy, inside or next to vLLM
    "pdproxy.fake_vllm": APPLICATION,  # a stand-in for a vLLM server, for the demo and tests
    "pdproxy.multiworker": PROCESSES,
    "pdproxy.single_process": PROCESSES,
    "pdproxy.cli": CLI,
    "pdproxy.__main__": CLI,
    "pdproxy.demo": PROCESSES,  # starts a proxy and fake instances as processes
}

# Edges (importer, imported) that break the rules today. Remove each as it is mended.
KNOWN_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The package's modules that `module` imports (a name imported from a module counts as
    that module, unless the name is a submodule itself)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pdproxy"):
                    yield _known_prefix(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("pdproxy"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield candidate if candidate in known else _known_prefix(base, known)


def _needs_vllm(path: Path) -> bool:
    """Whether the module imports vLLM when it is imported (only vLLM's own process has it)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            return True
    return False


def _known_prefix(name: str, known: set[str]) -> str:
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        graph[module] = {m for m in _imported(tree, module, is_package, known) if m != module}
    return graph


def layer_of(module: str) -> int:
    name = module
    while name not in LAYERS or (name == "pdproxy" and module != "pdproxy"):
        if "." not in name:
            raise KeyError(f"{module} has no layer: add it to LAYERS")
        name = name.rsplit(".", 1)[0]
    return LAYERS[name]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def _violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Edges that go up a layer, or from infrastructure into the domain."""
    found = set()
    for module, targets in graph.items():
        mine = layer_of(module)
        for target in targets:
            theirs = layer_of(target)
            upward = theirs > mine
            domain_in_infrastructure = mine == INFRASTRUCTURE and theirs != INFRASTRUCTURE
            if (upward or domain_in_infrastructure) and target != "pdproxy":
                found.add((module, target))
    return found


# What the vLLM-side package and the fake vLLM server may import of pdproxy besides
# themselves: the base types and the wire (DESIGN.md: "importing none of its HTTP stack").
BESIDE_THE_PROXY = ("pdproxy.vllm_side", "pdproxy.fake_vllm")
WIRE_AND_BASE = (
    "pdproxy",
    "pdproxy.base",
    "pdproxy.ids",
    "pdproxy.registry.messages",
    "pdproxy.registry.auth",
    "pdproxy.pairing.geometry",
    "pdproxy.vllm_side",
)


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_vllm_side_imports_only_the_base_types_and_the_wire() -> None:
    graph = _graph()
    found = sorted(
        (module, target)
        for module, targets in graph.items()
        if _within(module, BESIDE_THE_PROXY)
        for target in targets
        if not _within(target, (module.split(".")[0] + "." + module.split(".")[1],))
        and not (target == "pdproxy" or _within(target, WIRE_AND_BASE[1:]))
    )
    assert not found, "\n".join(f"  {a} -> {b}" for a, b in found)


def test_every_module_has_a_layer() -> None:
    for module in _graph():
        layer_of(module)


def test_imports_go_down_the_layers() -> None:
    violations = _violations(_graph())
    new = sorted(violations - KNOWN_VIOLATIONS)
    assert not new, "imports against the layers (docs/architecture.md, Layers):\n" + "\n".join(
        f"  {a} -> {b}" for a, b in new
    )
    mended = sorted(KNOWN_VIOLATIONS - violations)
    assert not mended, "no longer violations, remove them from KNOWN_VIOLATIONS:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in mended
    )


def test_no_import_cycle() -> None:
    graph = _graph()
    allowed = KNOWN_VIOLATIONS
    pruned = {m: {t for t in targets if (m, t) not in allowed} for m, targets in graph.items()}
    cycles = _cycles(pruned)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in cycles)


def test_the_graph_sees_known_edges() -> None:
    # The reader itself: a relative import, a from-import of a submodule, a plain import.
    graph = _graph()
    assert "pdproxy.http.server_protocol" in graph["pdproxy.proxy.exchange"]
    assert "pdproxy.registry.messages" in graph["pdproxy.registry.table"]
    assert layer_of("pdproxy.pairing.policies.round_robin") == CORE


_IMPORT_EACH_ALONE = """
import importlib, sys
failed = []
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n == "pdproxy" or n.startswith("pdproxy.")]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except Exception as exc:
        failed.append(f"{module}: {exc!r}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_module_imports_alone() -> None:
    """Each module imported with no other module of the package loaded before it: an import
    cycle that only some import orders reach fails here as the ImportError of a partly
    initialised module. One interpreter forgets the package's modules between imports; a
    compiled build's extension modules cannot be loaded twice, so there each module gets an
    interpreter of its own."""
    # __main__ runs the CLI; modules that import vLLM are loaded by vLLM itself.
    modules = sorted(
        m for m, path in _modules().items() if not m.endswith("__main__") and not _needs_vllm(path)
    )
    assert "pdproxy.cli" in modules and "pdproxy.proxy.app" in modules
    if not compiled_modules():
        failures = _import_each(modules)
    else:
        with ThreadPoolExecutor(max_workers=4) as pool:
            failures = "".join(pool.map(lambda module: _import_each([module]), modules))
    assert not failures, failures


def _import_each(modules: list[str]) -> str:
    """What failed, importing each of `modules` alone in one interpreter ("" if none)."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_ALONE, *modules],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return "" if done.returncode == 0 else done.stdout[-3000:] + done.stderr[-3000:]
