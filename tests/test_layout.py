"""The package's wings import one way only: app → lite → search → decoding → engine → models → plan.
Each imports the wings after it in that chain, never those before it; imports inside functions count."""

from __future__ import annotations

import ast
from pathlib import Path

import layerplan

PACKAGE = Path(layerplan.__file__).resolve().parent
WINGS = ("app", "lite", "search", "decoding", "engine", "models", "plan")  # each may import those after it


def _imports(path: Path) -> set[str]:
    """Every module a package file imports."""
    module = ".".join(("layerplan",) + path.relative_to(PACKAGE).with_suffix("").parts)
    return _imported(path.read_text(), module, path.name == "__init__.py")


def _imported(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` (module `module`) imports, anywhere in it: absolute names, relative
    imports resolved, and each imported name as a possible submodule."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _wing(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "layerplan" and parts[1] in WINGS else None


def _violations(wing: str) -> list[str]:
    above = set(WINGS[: WINGS.index(wing)])
    return sorted(f"{path.relative_to(PACKAGE)} imports {name}"
                  for path in (PACKAGE / wing).rglob("*.py") for name in _imports(path) if _wing(name) in above)


def test_models_import_nothing_from_the_engine():
    assert not [line for line in _violations("models") if "layerplan.engine" in line]


def test_each_wing_imports_only_the_wings_below_it():
    assert {wing: _violations(wing) for wing in WINGS} == {wing: [] for wing in WINGS}


def test_the_check_sees_deferred_and_relative_imports():
    source = ("def f():\n    from layerplan.engine import runner\n    import layerplan.search.scan\n"
              "from ..decoding import generate\nfrom . import architectures\n")
    found = _imported(source, "layerplan.models.sample")
    assert {"layerplan.engine.runner", "layerplan.search.scan", "layerplan.decoding.generate",
            "layerplan.models.architectures"} <= found
    assert {_wing(name) for name in found} >= {"engine", "search", "decoding", "models"}
