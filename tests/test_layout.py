"""The package's house: folders in layers, imports (module-level and lazy ones inside functions) only point down,
and no two modules import each other, directly or around a loop."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hf_posswap

PACKAGE = Path(hf_posswap.__file__).resolve().parent
# lowest first; a module may import from its own layer or any lower one
LAYERS = [
    {"errors", "registry", "version", "progress", "transformers_internals"},
    {"edits"},
    {"schemes"},
    {"families"},
    {"core"},
    {"persistence"},
    {"evaluation", "training"},
    {"cli"},
    {"__init__", "__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imports(path: Path) -> set[str]:
    """hf_posswap modules that ``path`` imports anywhere in its body, as dotted names below hf_posswap."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if path.name == "__init__.py" and name == "__init__":
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = [*base, *(node.module.split(".") if node.module else [])]
            if node.module:
                found.add(".".join(target))
            else:
                found.update(".".join([*target, alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and _ours(node.module or ""):
            found.add(_below_package(node.module))
        elif isinstance(node, ast.Import):
            found.update(_below_package(alias.name) for alias in node.names if _ours(alias.name))
    return {f for f in found if f}


def _ours(absolute: str) -> bool:
    return absolute == "hf_posswap" or absolute.startswith("hf_posswap.")


def _below_package(absolute: str) -> str:
    """``hf_posswap.core.swap`` -> ``core.swap``; the package itself (``import hf_posswap``) -> ``__init__``."""
    return "__init__" if absolute == "hf_posswap" else absolute.removeprefix("hf_posswap.")


def layer(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def modules() -> dict[str, set[str]]:
    return {module_name(path): imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_folder_and_root_module_has_a_layer() -> None:
    tops = {module_name(path).split(".")[0] for path in PACKAGE.rglob("*.py")}
    assert tops == set().union(*LAYERS), "give a new folder or root module a place in LAYERS"


def test_imports_only_point_down() -> None:
    upward = [f"{module} -> {target}" for module, targets in modules().items() for target in targets
              if layer(target) > layer(module)]
    assert not upward


def test_no_import_loops() -> None:
    graph = modules()

    def resolve(target: str) -> str:  # "core.swap" or a name inside a package's __init__
        return target if target in graph else target.rsplit(".", 1)[0]

    edges = {module: {resolve(t) for t in targets} - {module} for module, targets in graph.items()}
    for module in graph:  # a package imports its own submodules on purpose; loops are between modules
        if "." not in module and (PACKAGE / module).is_dir():
            edges[module] = {t for t in edges[module] if not t.startswith(module + ".")}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if seen.get(nxt) == 1:
                raise AssertionError("import loop: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = 2

    for module in sorted(edges):
        if module not in seen and module not in ("__init__", "__main__"):
            visit(module)


#: transformers' private names hf_posswap relies on; only transformers_internals.py may spell them
PRIVATE_TRANSFORMERS_NAMES = re.compile(r"\._init_weights\b|_is_hf_initialized|\._attn_implementation\b|"
                                        r"_model_mapping|_extra_content")
#: transformers submodules any module may import (public API)
PUBLIC_SUBMODULES = {"transformers.utils"}


def test_transformers_internals_are_reached_only_through_one_module() -> None:
    """A release that renames an internal is then a change to transformers_internals.py alone (docs/guarantees.md):
    no other module imports a transformers submodule or spells one of its private names."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "transformers_internals.py":
            continue
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("transformers."):
                if node.module not in PUBLIC_SUBMODULES:
                    found.append(f"{module_name(path)} imports {node.module}")
            elif isinstance(node, ast.Import):
                found += [f"{module_name(path)} imports {alias.name}" for alias in node.names
                          if alias.name.startswith("transformers.")]
        found += [f"{module_name(path)} spells {match.group()}" for match in PRIVATE_TRANSFORMERS_NAMES.finditer(text)]
    assert not found


def test_version_matches_pyproject() -> None:
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1) == hf_posswap.__version__


def test_every_import_names_something_that_exists() -> None:
    """Imports inside functions run only when the function does: check each one's module and names now."""
    import importlib.util

    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        package = [] if name == "__init__" else name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join(["hf_posswap", *base, *(node.module.split(".") if node.module else [])])
            module = importlib.import_module(target)
            missing += [f"{name}: {target}.{a.name}" for a in node.names
                        if not hasattr(module, a.name) and importlib.util.find_spec(f"{target}.{a.name}") is None]
    assert not missing


def test_the_standalone_bundle_holds_every_module_its_modules_import() -> None:
    """export_standalone concatenates BUNDLED in order and drops relative imports: every hf_posswap module a bundled
    module imports must be bundled before it (a new scheme or helper module left out breaks exported checkpoints)."""
    from hf_posswap.persistence.export import BUNDLED

    bundled = [name.replace("/", ".") for name in BUNDLED]
    graph = modules()
    problems = []
    for index, name in enumerate(bundled):
        top_level = top_level_imports(PACKAGE / f"{name.replace('.', '/')}.py")
        for target in sorted(graph[name]):
            if (PACKAGE / target.replace(".", "/")).is_dir():
                continue  # a package's __init__ re-exports names that live in bundled modules
            if target not in bundled:
                problems.append(f"{name} imports {target}, which is not bundled")
            elif target in top_level and target not in bundled[:index]:  # lazy imports run later: any order
                problems.append(f"{name} imports {target} at import time, but it is bundled after it")
    assert not problems, problems


def top_level_imports(path: Path) -> set[str]:
    """The hf_posswap modules ``path`` imports in its module body (not inside functions)."""
    package = module_name(path).split(".")[:-1]
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.level and node.module:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            found.add(".".join([*base, *node.module.split(".")]))
    return found


def test_every_registered_scheme_is_bundled() -> None:
    from hf_posswap.persistence.export import BUNDLED

    for name in hf_posswap.available_schemes():
        module = hf_posswap.schemes.SCHEME_REGISTRY.get(name).__module__.removeprefix("hf_posswap.")
        assert module.replace(".", "/") in BUNDLED, f"scheme {name!r} ({module}) is not in export.BUNDLED"


def test_bundled_modules_define_distinct_top_level_names() -> None:
    """The bundle is one namespace: a function, class or constant defined at the top of two bundled modules would
    silently replace the first one for every module bundled before the second."""
    from hf_posswap.persistence.export import BUNDLED

    owners: dict[str, str] = {}
    clashes = []
    for name in BUNDLED:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            for item in defined:
                if item in ("__all__", "logger"):  # per-module by design, read only at import time
                    continue
                if item == "__getattr__":  # PEP 562 hooks for classes registered lazily; the bundle registers its
                    continue  # classes eagerly (export's auto_map lines), so no bundled module ever consults one
                if item in owners:
                    clashes.append(f"{item}: {owners[item]} and {name}")
                owners[item] = name
    assert not clashes, clashes
