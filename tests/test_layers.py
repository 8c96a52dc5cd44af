"""The package's layers, as its folders show them: each group of modules imports only the groups below
it (imports inside functions count), so a newcomer can read `mcsd/` top-down. The order is the one
docs/design.md draws; a new top-level module or subpackage has to be placed here on purpose."""

from pathlib import Path

import pytest
from test_imports import import_graph

ROOT = Path(__file__).resolve().parent.parent

# Top to bottom. A module belongs to the first group whose name prefixes it.
LAYERS = (
    ("front ends", ("mcsd.cli", "mcsd.serve", "mcsd.train")),
    ("decoding", ("mcsd.decoding",)),
    ("drafting", ("mcsd.drafting",)),
    ("costs", ("mcsd.costs",)),
    ("core", ("mcsd.core",)),
    ("forward", ("mcsd.forward",)),
    ("loading", ("mcsd.loading",)),
    ("base", ("mcsd.config", "mcsd.errors", "mcsd")),
)


def _holds(name: str, module: str) -> bool:
    """A subpackage or module name holds itself and what lies below it; the root package only itself."""
    return module == name or ("." in name and module.startswith(name + "."))


def layer_of(module: str, layers=LAYERS) -> int:
    """Index of `module`'s layer in `layers` (0 = top); KeyError for a module no layer names."""
    for rank, (_, names) in enumerate(layers):
        if any(_holds(name, module) for name in names):
            return rank
    raise KeyError(module)


def upward_imports(graph, layers=LAYERS) -> list[str]:
    """Every import that runs from a layer to one above it, as 'a -> b (layer -> layer)'."""
    bad = []
    for a, b in sorted(graph.edges):
        la, lb = layer_of(a, layers), layer_of(b, layers)
        if lb < la:
            bad.append(f"{a} -> {b} ({layers[la][0]} imports {layers[lb][0]}, which sits above it)")
    return bad


def test_every_module_has_a_layer():
    graph = import_graph(ROOT / "mcsd")
    unplaced = []
    for module in graph:
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"modules no layer names (place them in tests/test_layers.py and docs/design.md): {unplaced}"


def test_imports_run_down_the_layers():
    graph = import_graph(ROOT / "mcsd")
    assert graph.number_of_nodes() > 40
    bad = upward_imports(graph)
    assert not bad, "imports that run up the layers (move the shared piece down):\n" + "\n".join(bad)


def test_the_top_level_stays_small():
    entries = sorted(p.name for p in (ROOT / "mcsd").iterdir() if p.name not in ("__init__.py", "__pycache__"))
    assert len(entries) <= 11, entries
    for group in ("decoding", "drafting", "costs", "core", "forward", "loading"):
        doc = (ROOT / "mcsd" / group / "__init__.py").read_text().strip()
        assert doc.startswith('"""') and len(doc) > 20, f"mcsd/{group}/__init__.py should say what the layer is for"


def test_an_upward_import_is_named(tmp_path):
    """The check can fail, and says which import is wrong."""
    pkg = tmp_path / "pkg"
    for sub in ("top", "low"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "top" / "a.py").write_text("from ..low import b\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from ..top.a import thing\n")
    layers = (("top", ("pkg.top",)), ("low", ("pkg.low",)), ("base", ("pkg",)))
    bad = upward_imports(import_graph(pkg), layers)
    assert bad == ["pkg.low.b -> pkg.top.a (low imports top, which sits above it)"]
    with pytest.raises(KeyError):
        layer_of("elsewhere.mod", layers)
