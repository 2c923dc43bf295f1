"""The README and docs say only what the tree holds: every path they name exists, every link
resolves, every `python -m pydatacopy.X` is a module, the README's example is the file CI's GPU
check runs, and its two set-up commands are the ones .ci/run runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("docs", "scripts", "tests", "examples", "include", "src", "python", "cmake", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])" % "|".join(re.escape(t) for t in TOP))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _text(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_named_path_exists(doc):
    missing = []
    for match in PATH.finditer(_text(doc)):
        name = match.group(1).rstrip(".")
        if any(c in name for c in "*{}<>") or name.endswith("/."):
            continue
        # Paths in docs/ may be written from the repository root or from docs/ itself.
        if not ((ROOT / name).exists() or (doc.parent / name).exists()):
            missing.append(name)
    assert not missing, f"{doc.name} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = [target for target in LINK.findall(_text(doc))
              if "://" not in target and not target.startswith("mailto:")
              and not (doc.parent / target).exists()]
    assert not broken, f"{doc.name} links to files that do not exist: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_named_module_exists(doc):
    missing = []
    for module in re.findall(r"python3? -m (pydatacopy(?:\.\w+)*)", _text(doc)):
        parts = module.split(".")
        base = ROOT / "python" / Path(*parts)
        if not (base.with_suffix(".py").exists() or (base / "__main__.py").exists()):
            missing.append(module)
    assert not missing, f"{doc.name} runs modules that do not exist: {missing}"


def test_the_readme_example_is_the_quickstart_file():
    """The README shows examples/quickstart.py as it is (scripts/gpu-check.sh runs that file)."""
    blocks = re.findall(r"```python\n(.*?)```", _text(ROOT / "README.md"), flags=re.S)
    assert blocks, "the README has no python example"
    assert blocks[0] == (ROOT / "examples" / "quickstart.py").read_text(encoding="utf-8")
    assert "examples/quickstart.py" in (ROOT / "scripts" / "gpu-check.sh").read_text(encoding="utf-8")


def test_the_readme_install_commands_are_what_ci_runs():
    readme, ci = _text(ROOT / "README.md"), _text(ROOT / ".ci" / "run")
    for command in ('pip install ".[test]"', "python -m pytest tests -q"):
        assert command in readme, f"the README no longer says {command!r}"
        assert command in ci, f".ci/run no longer runs {command!r}"


def test_the_first_screen_is_short():
    """What it is, figures, install and the example come before the table of contents."""
    lines = _text(ROOT / "README.md").splitlines()
    contents = next(i for i, line in enumerate(lines) if line.startswith("## Documentation"))
    assert contents <= 70, f"the README's first screen is {contents} lines before its contents"
