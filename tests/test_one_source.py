"""One source for each fact: a value the core exports through _C (an UPPER_CASE number, or a
dict enum of str -> int) must not be restated as a literal in python/pydatacopy. Every module is
parsed (ast); a module- or class-level assignment that binds a constant expression (int, float,
``1 << n``, ``2**n``, ``8 << 20``...) equal to an exported value, or a dict literal whose items are
an exported enum's, fails with file:line and the _C name to use instead."""

from __future__ import annotations

import ast
import operator
import pathlib

import pytest

_C = pytest.importorskip("pydatacopy._C")

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "pydatacopy"
TRIVIAL = 16  # 0, 1, 2, 4, 16...: too common to mean the core's fact (unless bound to the same name)
# The language's facts, which Python may state itself (bound to these names only).
LANGUAGE_FACTS = {"INT32_MAX": 2**31 - 1, "UINT32_MAX": 2**32 - 1, "INT64_MAX": 2**63 - 1,
                  "SIZE_MAX": 2**64 - 1}
# (file, name) bound to a value that is its own fact and only equal to an export, with why; or
# another engineer's pending change. An entry no longer found is not an error.
OWN_FACTS = {
    ("pydatacopy/bench/_cli.py", "MAX_MESSAGE_BYTES"): "the bench's cap on a message size, not a core limit",
    ("pydatacopy/runtime/probes.py", "_SO_ACCEPTCON"): "Linux's flag bit of a listening socket, 64 KiB by chance",
    ("pydatacopy/compat/deep_ep/utils.py", "SCALE_BLOCK"): "DeepEP's fp8 scale granularity, 128 channels",
    ("pydatacopy/bench/_harness.py", "LARGE_MESSAGE_BYTES"): "the bench's size from which a row times fewer "
                                                            "calls, 64 MiB as the core's narrow cut by chance",
    ("pydatacopy/compat/deep_ep/utils.py", "EXPERTS_ROOM"): "the compat layer's room for experts (DeepEP's "
                                                             "NUM_MAX_LOCAL_EXPERTS is also 1024)",
    ("pydatacopy/compat/deep_ep/utils.py", "TOPK_ROOM"): "the compat layer's room for top-k entries a row, "
                                                          "32 as the narrow send blocks by chance",
}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
              ast.FloorDiv: operator.floordiv, ast.Div: operator.truediv, ast.BitOr: operator.or_}


def exported_numbers() -> dict[str, int | float]:
    return {name: value for name, value in vars(_C).items()
            if name.isupper() and isinstance(value, (int, float)) and not isinstance(value, bool)}


def exported_enums() -> dict[str, dict[str, int]]:
    return {name: dict(value) for name, value in vars(_C).items()
            if name.isupper() and isinstance(value, dict) and value
            and all(isinstance(k, str) and isinstance(v, int) for k, v in value.items())}


def constant(node: ast.AST):
    """The value of a constant expression of numbers, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = constant(node.operand)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = constant(node.left), constant(node.right)
        if left is None or right is None:
            return None
        if isinstance(node.op, (ast.Pow, ast.LShift)) and right > 128:
            return None
        try:
            return _OPERATORS[type(node.op)](left, right)
        except (ArithmeticError, TypeError, ValueError):
            return None
    return None


def enum_items(node: ast.AST) -> dict[str, int] | None:
    if not isinstance(node, ast.Dict) or not node.keys:
        return None
    items = {}
    for key, value in zip(node.keys, node.values):
        number = constant(value)
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(number, int)):
            return None
        items[key.value] = number
    return items


def bindings(tree: ast.Module):
    """(target names, value node, line) of every module- and class-level assignment."""
    bodies = [tree.body]
    while bodies:
        for statement in bodies.pop():
            if isinstance(statement, ast.ClassDef):
                bodies.append(statement.body)
            elif isinstance(statement, (ast.If, ast.Try)):
                bodies.append(statement.body + statement.orelse
                              + [s for h in getattr(statement, "handlers", []) for s in h.body])
            elif isinstance(statement, ast.Assign):
                names = [t.id for t in statement.targets if isinstance(t, ast.Name)]
                yield names, statement.value, statement.lineno
            elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
                names = [statement.target.id] if isinstance(statement.target, ast.Name) else []
                yield names, statement.value, statement.lineno


def restatements(root: pathlib.Path, numbers, enums) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(root.parent)
        for names, value, line in bindings(tree):
            if any((str(where), n) in OWN_FACTS for n in names):
                continue
            number = constant(value)
            if number is not None and not any(LANGUAGE_FACTS.get(n) == number for n in names):
                for name, exported in numbers.items():
                    if number == exported and (abs(exported) > TRIVIAL or name in names):
                        found.append((str(where), line, f"{', '.join(names) or 'a value'} = {number!r} "
                                     f"restates the core's value: use _C.{name}"))
            items = enum_items(value)
            if items is not None:
                for name, exported in enums.items():
                    if all(exported.get(k) == v for k, v in items.items()) and len(items) >= 2:
                        found.append((str(where), line, f"{', '.join(names) or 'a dict'} restates the "
                                     f"core's enum: use _C.{name}"))
    return [f"{where}:{line}: {what}" for where, line, what in sorted(found)]


def test_the_core_exports_its_facts():
    numbers, enums = exported_numbers(), exported_enums()
    for name in ("MAX_TIMEOUT_S", "MAX_CHUNK_BYTES", "MAX_SEND_BLOCKS", "MAX_RANKS_PER_GPU",
                 "NVSHMEM_DEFAULT_SYMMETRIC_SIZE"):
        assert name in numbers, name
    assert enums["PATHS"] == {"auto": 0, "copy_engine": 1, "sm": 2, "rma": 3}
    assert "PATHS" in _C.__dict__ and "copy_engine" not in enums["BATCH_PATHS"]


def test_the_check_finds_a_restatement(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text("LIMIT = 1 << 40\nclass K:\n    BLOCKS = 2**10\n"
                                  "CODES = {'auto': 0, 'rma': 3}\nSMALL = 4\nOTHER = 12345\n"
                                  "INT32_MAX = 2**31 - 1\nCAPACITY = 2**31 - 1\n")
    found = restatements(package, {"MAX_CHUNK_BYTES": 1 << 40, "MAX_SEND_BLOCKS": 1024, "FOUR": 4,
                          "MAX_CAPACITY": 2**31 - 1},
                         {"PATHS": {"auto": 0, "copy_engine": 1, "sm": 2, "rma": 3}})
    assert found == ["pkg/m.py:1: LIMIT = 1099511627776 restates the core's value: use _C.MAX_CHUNK_BYTES",
                     "pkg/m.py:3: BLOCKS = 1024 restates the core's value: use _C.MAX_SEND_BLOCKS",
                     "pkg/m.py:4: CODES restates the core's enum: use _C.PATHS",
                     "pkg/m.py:8: CAPACITY = 2147483647 restates the core's value: use _C.MAX_CAPACITY"]


def test_no_python_literal_repeats_a_core_value():
    found = restatements(PACKAGE, exported_numbers(), exported_enums())
    assert not found, "values the core exports, restated in Python:\n" + "\n".join(found)
