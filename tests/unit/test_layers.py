"""The import contract: stages import only stages below them, and Ray stays at the edges.

raying's packages are named after the stages a sample passes through. A lower stage never
imports a higher one, at module level or inside a function: the layering is what lets a reader
find where a line belongs, and what keeps the numpy core testable without a cluster.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "raying"

# Lowest first. A module may import its own layer and any layer listed before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("raying.errors", "raying.options"),
    ("raying.storage",),
    ("raying.image",),
    ("raying.dataset",),
    ("raying.sampling",),
    ("raying.read",),
    ("raying.engine",),
    ("raying.loader",),
    ("raying.train",),
    ("raying",),  # the public surface, raying/__init__.py: re-exports names from below
    ("raying.tools",),  # commands, written against the public surface as users write

    ("raying.bench",),
)
# Where ``import ray`` may stand at module level; elsewhere Ray is imported where it is used.
# (raying.train.config subclasses Ray Train's DataConfig; only Train drivers import it.)
RAY_AT_MODULE_LEVEL = ("raying.engine", "raying.sampling.store", "raying.sampling.store_actor",
                       "raying.train.config", "raying.tools", "raying.bench")
# Heavy frameworks are imported lazily everywhere in the library (a read worker that never
# converts to torch never pays for importing it).
LAZY_ONLY = ("torch", "tensorflow", "keras", "matplotlib", "pandas")


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix that names ``module``'s layer."""
    best, best_len = -1, -1
    for level, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = level, len(p)
    if best < 0:
        msg = f"{module} belongs to no layer; add its package to LAYERS in {__file__}"
        raise AssertionError(msg)
    return best


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in ``source``."""
    tree = ast.parse(source)
    top = {id(node) for node in tree.body}
    # An import inside ``if TYPE_CHECKING:`` or ``try:`` at the top is still module level.
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            top.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, node.lineno, id(node) in top))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                # ``from raying.read import cache`` imports the module raying.read.cache.
                full = f"{target}.{alias.name}"
                found.append((full if _is_module(full) else target, node.lineno,
                              id(node) in top))
    return found


def _is_module(name: str) -> bool:
    if not name.startswith("raying."):
        return False
    rel = pathlib.Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every broken rule in ``sources`` ({module: (source text, is package)})."""
    out = []
    for module, (source, is_package) in sorted(sources.items()):
        level = layer_of(module)
        for target, line, module_level in imports_of(source, module, is_package):
            root = target.split(".")[0]
            if root == "raying" and layer_of(target) > level:
                out.append(f"{module}:{line} imports {target}, a higher stage "
                           f"({LAYERS[layer_of(target)][0]} above {LAYERS[level][0]})")
            if root == "ray" and module_level and not module.startswith(RAY_AT_MODULE_LEVEL):
                out.append(f"{module}:{line} imports {target} at module level; import it "
                           f"inside the function that uses it")
            if root in LAZY_ONLY and module_level and not module.startswith(
                    ("raying.tools", "raying.bench")):
                out.append(f"{module}:{line} imports {target} at module level; import it "
                           f"lazily (read workers must not pay for it)")
    return out


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p, PACKAGE): (p.read_text(), p.name == "__init__.py")
            for p in PACKAGE.rglob("*.py")}


def test_the_package_keeps_the_import_contract():
    found = violations(package_sources())
    assert found == [], "\n".join(found)


def test_only_init_errors_and_options_sit_at_the_package_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "errors.py", "options.py"]


def test_every_package_says_what_it_owns():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init} needs a docstring saying what it owns"


@pytest.mark.parametrize(("module", "line", "expected"), [
    ("raying.storage.files", "from raying.loader.pipeline import Pipeline",
     "raying.storage.files:1 imports raying.loader.pipeline, a higher stage"),
    ("raying.image.decode", "def f():\n    from raying.read import task\n",
     "raying.image.decode:2 imports raying.read.task, a higher stage"),
    ("raying.sampling.table", "import ray", "imports ray at module level"),
    ("raying.read.task", "import torch", "imports torch at module level"),
])
def test_an_upward_import_is_caught(module, line, expected):
    sources = package_sources()
    source, is_package = sources[module]
    sources[module] = (line + "\n" + source, is_package)
    found = violations(sources)
    assert any(expected in v for v in found), found


def test_a_downward_or_lazy_framework_import_is_allowed():
    sources = {"raying.loader.x": ("from raying.read import task\nimport numpy\n"
                                   "def f():\n    import torch\n    import ray\n", False)}
    assert violations(sources) == []
