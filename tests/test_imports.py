"""Imports flow one way: no circle between `mcsd`'s modules (imports inside functions count too), and
the runtime package never imports the training package `mcsd.train`."""

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent


def _modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} for every module under the package directory `root`."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that module `name` imports, at any depth: `import a.b`,
    `from .b import c` (-> a.b, or a.b.c where c is a module) and `from . import b` (-> a.b)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                               # relative: resolve against the file's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:                     # a submodule where the name is one, else the module
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {t for t in targets if t in modules and t != name}


def import_graph(root: Path) -> nx.DiGraph:
    """Module -> module it imports, for every module of the package at `root`."""
    modules = _modules(root)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    graph.add_edges_from((name, t) for name, path in modules.items() for t in _edges(name, path, modules))
    return graph


def test_no_import_circle_in_mcsd():
    graph = import_graph(ROOT / "mcsd")
    assert graph.number_of_nodes() > 40 and graph.number_of_edges() > 80     # the walk saw the package
    cycles = sorted(" -> ".join([*c, c[0]]) for c in nx.simple_cycles(graph))
    assert not cycles, "import circles (move the shared piece down to a module both import):\n" + "\n".join(cycles)


def test_the_runtime_never_imports_the_training_package():
    graph = import_graph(ROOT / "mcsd")
    training = {n for n in graph if n == "mcsd.train" or n.startswith("mcsd.train.")}
    bad = sorted(f"{a} -> {b}" for a, b in graph.edges if b in training and a not in training)
    assert not bad, f"runtime modules importing mcsd.train: {bad}"


def test_the_walk_finds_a_planted_circle(tmp_path):
    """The checks above can fail: relative, absolute and function-level imports all make edges."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert set(graph.edges) == {("pkg.a", "pkg.sub.b"), ("pkg.sub.b", "pkg.c"), ("pkg.c", "pkg.a")}
    assert len(list(nx.simple_cycles(graph))) == 1


# The layers, lowest first, as README's "Layout" names them (decoding, drafting, costs, core, forward,
# loading, with the front ends above): a module imports its own layer and the ones below it. `mcsd`
# itself, `config` and `errors` sit beneath everything; `cli` maps the flags and loads the pair, which
# the server reuses; `train` is apart (nothing imports it, its own test above).
LAYERS = [("mcsd", "mcsd.config", "mcsd.errors"), ("mcsd.loading",), ("mcsd.forward",), ("mcsd.core",),
          ("mcsd.costs",), ("mcsd.drafting",), ("mcsd.decoding",), ("mcsd.cli",), ("mcsd.serve",)]

# Imports that go up the order, each with why it stays (move the shared piece down rather than add one):
# none today.
UPWARD: set[tuple[str, str]] = set()


def _layer(module: str) -> int | None:
    """The index in LAYERS of `module`'s layer (the longest prefix that names one), None for `mcsd.train`."""
    if module == "mcsd.train" or module.startswith("mcsd.train."):
        return None
    best = max((prefix for group in LAYERS for prefix in group
                if module == prefix or module.startswith(prefix + ".")), key=len)
    return next(i for i, group in enumerate(LAYERS) if best in group)


def test_imports_go_down_the_layers_or_are_named_exceptions():
    graph = import_graph(ROOT / "mcsd")
    upward = set()
    for a, b in graph.edges:
        la, lb = _layer(a), _layer(b)
        if la is not None and lb is not None and lb > la:
            upward.add((a, b))
    new = sorted(f"{a} -> {b}" for a, b in upward - UPWARD)
    assert not new, ("imports up the layer order (move the shared piece down, or name it in UPWARD with why):\n"
                     + "\n".join(new))
    assert UPWARD - upward == set(), f"named exceptions no module makes any more (drop them): {UPWARD - upward}"


def test_the_layer_check_finds_an_import_up_the_order():
    """The check above can fail: a forward module reading the decoder, or loading reading the forward."""
    assert _layer("mcsd.forward.native") < _layer("mcsd.decoding.decoder")
    assert _layer("mcsd.loading.cache") < _layer("mcsd.forward.quant") < _layer("mcsd.core.sampling")
    assert _layer("mcsd.cli.args") < _layer("mcsd.serve.cli") and _layer("mcsd.train.data") is None
