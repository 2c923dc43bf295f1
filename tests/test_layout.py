"""The Python package's layout, read with ast (nothing imported): no module over 450 lines, no
import circle between modules, and ``ops`` importing no feature; and no C++ file of the core,
the bindings or the public headers over 800 lines outside the kernels' folder.

Imports are collected at module level and inside functions, relative and absolute
(``pydatacopy.x``); ``from . import x`` counts as an import of the submodule x when there is
one, else of the package. A package's ``__init__.py`` is the package's node, so a package
re-exporting its own submodules is an edge like any other (a submodule that imports its own
package back would close a circle, and is caught)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "python" / "pydatacopy"
MAX_LINES = 450
CPP_ROOTS = [ROOT.parents[1] / "src", ROOT.parents[1] / "include"]
CPP_MAX_LINES = 800
CPP_SUFFIXES = (".cpp", ".hpp", ".h", ".cc")
FEATURES = ("runtime", "rma", "registration", "send_recv", "token_exchange", "moe")
#: What ops may import besides itself: the core and the helpers every feature shares.
OPS_MAY_IMPORT = ("pydatacopy._C", "pydatacopy._torch_utils", "pydatacopy._limits")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module under `root` (a package's name -> its __init__.py);
    compiled modules (a .pyi stub beside them: _C) are named too, as leaves."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.setdefault(".".join(parts), path)
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports, anywhere in its code."""
    if path.suffix == ".pyi":
        return set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = name.split(".")[0]
    found: set[str] = set()

    def deepest(dotted: str) -> str | None:
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in known:
                return ".".join(parts[:end])
        return None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == top and (target := deepest(alias.name)):
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            elif node.module and node.module.split(".")[0] == top:
                source = node.module
            else:
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else deepest(source)
                if target:
                    found.add(target)
    found.discard(name)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def long_modules(root: Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root.parent)}: {lines} lines"
            for path in sorted(root.rglob("*.py"))
            if (lines := len(path.read_text().splitlines())) > MAX_LINES]


def test_no_module_is_over_the_line_limit():
    assert not long_modules(), f"modules over {MAX_LINES} lines: {long_modules()}"


def long_cpp_files(roots=CPP_ROOTS) -> list[tuple[str, int]]:
    """C++ host files over CPP_MAX_LINES, outside any `kernels` folder (CUDA kernels may run long)."""
    return [(str(path), lines) for root in roots for path in sorted(root.rglob("*"))
            if path.suffix in CPP_SUFFIXES and "kernels" not in path.relative_to(root).parts
            and (lines := len(path.read_text().splitlines())) > CPP_MAX_LINES]


def test_no_cpp_file_is_over_the_line_limit():
    assert all(root.is_dir() for root in CPP_ROOTS), CPP_ROOTS
    assert not long_cpp_files(), f"C++ files over {CPP_MAX_LINES} lines: {long_cpp_files()}"


def test_the_cpp_check_finds_a_long_file_and_spares_kernels(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "core" / "long.cpp").write_text("x\n" * (CPP_MAX_LINES + 1))
    (tmp_path / "core" / "short.hpp").write_text("x\n" * CPP_MAX_LINES)
    (tmp_path / "kernels" / "long.cpp").write_text("x\n" * (CPP_MAX_LINES + 1))
    assert long_cpp_files([tmp_path]) == [(str(tmp_path / "core" / "long.cpp"), CPP_MAX_LINES + 1)]


def test_no_import_circle():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_check_finds_a_circle_and_a_function_level_import(tmp_path):
    """The check itself: an import inside a function, relative, closes a circle."""
    package = tmp_path / "pydatacopy"
    (package / "feature").mkdir(parents=True)
    (package / "__init__.py").write_text("from .feature import thing\n")
    (package / "feature" / "__init__.py").write_text("from .thing import thing\n")
    (package / "feature" / "thing.py").write_text("from ..ops import x\n\ndef thing():\n    pass\n")
    (package / "ops.py").write_text("def x():\n    from .feature import thing as module\n")
    cycle = find_cycle(graph(package))
    assert cycle is not None and "pydatacopy.ops" in cycle and "pydatacopy.feature.thing" in cycle, cycle


def test_ops_imports_no_feature():
    edges = graph()
    def in_ops(name: str) -> bool:
        return name == "pydatacopy.ops" or name.startswith("pydatacopy.ops.")

    seen, todo = set(), [name for name in edges if in_ops(name)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(edges.get(name, ()))
    outside = sorted(name for name in seen if not in_ops(name) and name not in OPS_MAY_IMPORT)
    assert not outside, f"pydatacopy.ops reaches {outside}: it may import only {OPS_MAY_IMPORT}"


def test_every_package_folder_has_an_init():
    folders = {path.parent for path in ROOT.rglob("*.py") if "__pycache__" not in path.parts}
    assert sorted(str(f) for f in folders if not (f / "__init__.py").exists()) == []


@pytest.mark.parametrize("feature", FEATURES + ("ops", "compat", "compat.deep_ep"))
def test_each_feature_package_says_what_it_owns_and_exports(feature):
    init = ROOT.joinpath(*feature.split(".")) / "__init__.py"
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree), f"{init}: starts with a docstring saying what it owns and may import"
    exported = [node for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
    assert exported, f"{init}: defines __all__"


#: pydatacopy.__all__ before the package was split into feature folders: the public API.
PUBLIC = {
    "AllToAll", "DoubleBufferManager", "PreparedPutMany", "MoeDispatcher", "MoeHandle",
    "all_to_all_v",
    "barrier", "empty", "free", "get", "group", "is_registered", "is_symmetric", "peer_view",
    "prepare_put_many", "put", "put_blocks", "put_many", "put_signal", "quiet", "recv", "register",
    "send", "sendrecv", "setup_send_recv", "signal_set", "signal_wait", "stats", "unregister", "Error",
    "TimeoutError", "UNIQUE_ID_BYTES", "check_errors", "choose_device", "finalize", "get_unique_id",
    "init", "init_nvshmem", "is_initialized", "my_pe", "n_pes", "nvshmem_versions", "share_unique_id",
}


def test_the_public_api_is_the_features_own_objects():
    import importlib

    import pydatacopy

    assert set(pydatacopy.__all__) == PUBLIC
    for feature in FEATURES:
        package = importlib.import_module(f"pydatacopy.{feature}")
        for name in package.__all__:
            if name in PUBLIC:
                assert getattr(pydatacopy, name) is getattr(package, name), (feature, name)
    assert all(hasattr(pydatacopy, name) for name in PUBLIC)
