"""The packages import one way (docs/architecture.md, "Packages").

Every import in product code and in bench/ is read with `ast`: module level, inside functions (lazy) and
under `if TYPE_CHECKING:` alike, relative imports resolved. Two checks: no edge between
packages that ALLOWED below does not list, and no cycle between modules. Imports through
`importlib.import_module` with a computed name (worker_client/engine/__init__.py's lazy
torch names) are not seen; they stay inside one package.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Top-level package -> its folder: the product's, and bench (benchmarks and the tooling of
# tests), whose imports are read too so that no product package can lean on it.
SOURCES = {
    "lattice": ROOT / "protos" / "lattice",
    "common": ROOT / "common",
    "service": ROOT / "service",
    "worker_client": ROOT / "worker_client",
    "bench": ROOT / "bench",
}
PRODUCT = ("lattice", "common", "service", "worker_client")

# The design: each package and the packages of ours it may import. A module belongs to the
# longest package name that prefixes it (service.server.interceptors.auth is service.server);
# imports inside one package are free (but may not form a cycle, see below).
ALLOWED: dict[str, frozenset[str]] = {
    # Generated from protos/: imports nothing of ours.
    "lattice": frozenset(),
    # What the worker and the service both use.
    "common": frozenset({"lattice"}),
    # The scheduling core: plain objects, drivable from a test.
    "service.core": frozenset({"common"}),
    # serve's settings: flags, environment, file.
    "service.settings": frozenset({"common", "service.core"}),
    # The durable stores (SQLite, PostgreSQL) the core saves through.
    "service.state": frozenset({"common", "service.core"}),
    # The grpc.aio edge of the scheduler process.
    "service.server": frozenset(
        {"common", "lattice", "service.core", "service.settings", "service.state"}
    ),
    # A replica: the server's servicer and start, over the PostgreSQL store.
    "service.replicas": frozenset(
        {"common", "lattice", "service.core", "service.settings", "service.state", "service.server"}
    ),
    # The HTTP gateway: a client of the scheduler over gRPC, nothing of the service.
    "service.gateway": frozenset({"common", "lattice"}),
    # The reference engine: a library the worker loop drives (the block hash is common's).
    "worker_client.engine": frozenset({"common"}),
    # The vLLM engine behind the same protocol (vllm itself is imported only here).
    "worker_client.engine_vllm": frozenset({"common", "worker_client.engine"}),
    # The worker process: loop, client, session, conversion, the engines registry.
    "worker_client": frozenset(
        {"common", "lattice", "worker_client.engine", "worker_client.engine_vllm"}
    ),
    # The simulator: the real core and the real worker loop on a virtual clock.
    "service.sim": frozenset(
        {
            "common",
            "lattice",
            "service.core",
            "service.settings",
            "service.server",
            "worker_client",
            "worker_client.engine",
        }
    ),
    # The lattice-scheduler command line: starts any of the above.
    "service.cli": frozenset(
        {
            "common",
            "lattice",
            "service.core",
            "service.settings",
            "service.state",
            "service.server",
            "service.replicas",
            "service.gateway",
            "service.sim",
        }
    ),
    # service/__init__.py and service/__main__.py (python -m service).
    "service": frozenset({"service.cli"}),
    # Benchmarks and the tooling of tests (fault stacks, engine benchmarks, an honest fake
    # worker), outside the wheel: no product package imports it (checked below), so it may
    # join core and worker.
    "bench": frozenset(
        {
            "common",
            "lattice",
            "service.core",
            "service.settings",
            "service.state",
            "service.server",
            "service.sim",
            "service.cli",
            "worker_client",
            "worker_client.engine",
        }
    ),
}

# Inside service.core, a decision's life reads one way: each sub-package and those of the
# core it may not import. The tables (and the steady step kept on them) know nothing of
# reports or deciding; what is learned and the caches know nothing of their users.
CORE_FORBIDDEN: dict[str, frozenset[str]] = {
    "service.core.tables": frozenset({"service.core.decide", "service.core.report"}),
    "service.core.decide": frozenset({"service.core.report", "service.core.persist"}),
    "service.core.cache": frozenset(
        {
            "service.core.decide",
            "service.core.report",
            "service.core.persist",
            "service.core.learn",
            "service.core.tables",
        }
    ),
    "service.core.learn": frozenset(
        {
            "service.core.decide",
            "service.core.report",
            "service.core.persist",
            "service.core.tables",
            "service.core.cache",
        }
    ),
}

# Third-party packages a package may not import at all.
FORBIDDEN_THIRD_PARTY = {
    "service.core": frozenset(
        {"grpc", "grpc_health", "grpc_reflection", "google", "prometheus_client"}
    ),
    "common": frozenset({"torch"}),
}

# vLLM lives in an environment of its own: only its adapter imports it.
ONLY_IMPORTED_BY = {"vllm": frozenset({"worker_client.engine_vllm"})}

# Only the simulator joins the scheduling core and the worker loop (and bench, which no
# product package imports: checked below).
BOTH_CORE_AND_WORKER = frozenset({"service.sim", "bench"})


@dataclass(frozen=True)
class Edge:
    importer: str  # module name
    imported: str  # module name, or a third-party top-level name
    where: str  # path:line

    def __str__(self) -> str:
        return f"{self.where}: {self.importer} imports {self.imported}"


def _modules(sources: dict[str, Path]) -> dict[str, Path]:
    """Every module name -> its file (a package is its __init__.py)."""
    found = {}
    for top, folder in sources.items():
        for path in folder.rglob("*.py"):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _edges(modules: dict[str, Path]) -> list[Edge]:
    """Every import statement of every module, anywhere in its body."""
    edges = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            where = f"{_shown(path)}:{node.lineno}"
            if isinstance(node, ast.Import):
                edges.extend(
                    Edge(name, _module_of(alias.name, modules), where) for alias in node.names
                )
            else:
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                for alias in node.names:
                    # `from pkg import mod` imports the module pkg.mod where one exists.
                    sub = f"{base}.{alias.name}"
                    edges.append(
                        Edge(name, sub if sub in modules else _module_of(base, modules), where)
                    )
    return edges


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _module_of(dotted: str, modules: dict[str, Path]) -> str:
    """The longest prefix of `dotted` that is one of our modules, else its top-level name."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return parts[0]


MODULES = _modules(SOURCES)
EDGES = _edges(MODULES)


def package_of(module: str) -> str | None:
    """The ALLOWED package a module of ours belongs to; None for third-party names."""
    if module not in MODULES:
        return None
    matches = [p for p in ALLOWED if module == p or module.startswith(p + ".")]
    return max(matches, key=len)


def test_every_product_module_belongs_to_a_package_of_the_design():
    assert all(package_of(m) is not None for m in MODULES)
    assert {package_of(m) for m in MODULES} == set(ALLOWED), "a package of ALLOWED has no module"


def test_the_design_itself_has_no_cycle_between_packages():
    cycles = _cycles({p: set(allowed) for p, allowed in ALLOWED.items()})
    assert not cycles, f"ALLOWED has cycles: {cycles}"


def test_no_import_between_packages_that_the_design_does_not_allow():
    wrong = [
        str(e)
        for e in EDGES
        if (src := package_of(e.importer))
        and (dst := package_of(e.imported))
        and src != dst
        and dst not in ALLOWED[src]
    ]
    assert not wrong, "imports the design does not allow:\n" + "\n".join(wrong)


def _core_part(module: str) -> str | None:
    """The sub-package of service.core that `module` is in (None: directly in the core,
    or outside it)."""
    parts = module.split(".")
    if parts[:2] != ["service", "core"] or len(parts) < 4:
        return None
    return ".".join(parts[:3])


def test_the_core_sub_packages_import_one_way():
    assert set(CORE_FORBIDDEN) <= {_core_part(m) for m in MODULES} - {None}
    wrong = [
        str(e)
        for e in EDGES
        if _core_part(e.imported) in CORE_FORBIDDEN.get(_core_part(e.importer), ())
    ]
    assert not wrong, "imports inside the core that its layout does not allow:\n" + "\n".join(wrong)


def test_the_tables_read_no_config_and_the_stores_records_no_tables():
    tables_config = [
        str(e)
        for e in EDGES
        if _core_part(e.importer) == "service.core.tables" and e.imported == "service.core.config"
    ]
    assert not tables_config, "the tables are mechanism:\n" + "\n".join(tables_config)
    records = [
        str(e)
        for e in EDGES
        if e.importer == "service.core.persist.store"
        and _core_part(e.imported) == "service.core.tables"
    ]
    assert not records, "\n".join(records)


def test_the_scheduler_class_stays_under_300_lines():
    tree = ast.parse(MODULES["service.core.scheduler"].read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"]
    assert cls.end_lineno - cls.lineno + 1 <= 300, "move a concern out of Scheduler"


def test_the_core_keeps_few_modules_at_its_top():
    top = [
        m
        for m in MODULES
        if m.startswith("service.core.")
        and m.count(".") == 2
        and not MODULES[m].name == "__init__.py"
    ]
    assert len(top) <= 7, top  # with service/core/__init__.py: 8


def test_forbidden_third_party_packages_are_not_imported():
    wrong = [
        str(e)
        for e in EDGES
        if package_of(e.imported) is None
        and e.imported in FORBIDDEN_THIRD_PARTY.get(package_of(e.importer), ())
    ]
    assert not wrong, "\n".join(wrong)


def test_only_the_simulator_imports_both_the_core_and_the_worker_loop():
    reaches = defaultdict(set)
    for e in EDGES:
        dst = package_of(e.imported)
        if dst in ("service.core", "worker_client", "worker_client.engine"):
            reaches[package_of(e.importer)].add("core" if dst == "service.core" else "worker")
    both = {p for p, kinds in reaches.items() if kinds == {"core", "worker"}}
    assert both <= BOTH_CORE_AND_WORKER, both
    service_to_worker = [
        str(e)
        for e in EDGES
        if package_of(e.importer).startswith("service")
        and package_of(e.importer) not in BOTH_CORE_AND_WORKER
        and (package_of(e.imported) or "").startswith("worker_client")
    ]
    assert not service_to_worker, "\n".join(service_to_worker)


def test_no_cycle_between_modules():
    graph = defaultdict(set)
    for e in EDGES:
        if e.imported in MODULES and e.imported != e.importer:
            graph[e.importer].add(e.imported)
    cycles = _cycles(graph)
    where = {(e.importer, e.imported): e.where for e in EDGES}
    lines = []
    for cycle in cycles:
        inside = [
            f"  {where[(a, b)]}: {a} -> {b}" for a in cycle for b in sorted(graph[a]) if b in cycle
        ]
        lines.append(" <-> ".join(cycle) + "\n" + "\n".join(inside))
    assert not cycles, "module cycles:\n" + "\n".join(lines)


def test_the_walker_sees_lazy_relative_and_type_checking_imports(tmp_path):
    """Else the checks above could pass on a blind walk."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("from . import leaf\n")
    (tmp_path / "pkg" / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..other import Thing\n"
        "def later():\n    import pkg.other\n    from pkg.sub import missing_name\n"
    )
    (tmp_path / "pkg" / "other.py").write_text("import json\n")
    modules = _modules({"pkg": tmp_path / "pkg"})
    edges = {(e.importer, e.imported) for e in _edges(modules)}
    assert edges == {
        ("pkg.sub", "pkg.sub.leaf"),
        ("pkg.sub.leaf", "typing"),
        ("pkg.sub.leaf", "pkg.other"),
        ("pkg.sub.leaf", "pkg.sub"),
        ("pkg.other", "json"),
    }


def test_cycles_are_found_with_their_members():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"f"}}
    assert _cycles(graph) == [["a", "b", "c"], ["d", "e"]]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_product_package_imports_bench():
    wrong = [
        str(e)
        for e in EDGES
        if e.importer.split(".")[0] in PRODUCT and e.imported.split(".")[0] == "bench"
    ]
    assert not wrong, "\n".join(wrong)


def test_the_product_check_would_see_an_import_of_bench(tmp_path):
    """Else the check above could pass on a walk that never reads bench."""
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "leaf.py").write_text("def later():\n    from bench import x\n")
    edges = _edges(_modules({"service": tmp_path / "service"}))
    assert [(e.importer, e.imported) for e in edges] == [("service.leaf", "bench")]


def test_vllm_is_imported_only_by_its_adapter():
    wrong = [
        str(e)
        for e in EDGES
        if package_of(e.imported) is None
        and e.imported in ONLY_IMPORTED_BY
        and package_of(e.importer) not in ONLY_IMPORTED_BY[e.imported]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_vllm_adapter_is_imported_lazily_outside_its_package():
    """The worker imports worker_client.engine_vllm inside functions only, so that the
    reference engine's workers never load it (nor need vLLM's environment)."""
    wrong = []
    for name, path in MODULES.items():
        if package_of(name) == "worker_client.engine_vllm":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "worker_client.engine_vllm"
            ):
                wrong.append(f"{_shown(path)}:{node.lineno}")
            if isinstance(node, ast.Import) and any(
                a.name.startswith("worker_client.engine_vllm") for a in node.names
            ):
                wrong.append(f"{_shown(path)}:{node.lineno}")
    assert not wrong, "\n".join(wrong)
