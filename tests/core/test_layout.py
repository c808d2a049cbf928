"""The layout's one rule: the collaborative core depends on nothing that depends on it."""

import ast
import re
from pathlib import Path

from tests.helpers import ROOT

CORE = ROOT / "common"
TOOLS = CORE / "tools"
FORBIDDEN_IN_CORE = ("common.tools", "albert", "swav", "scripts", "tests")
FORBIDDEN_IN_TOOLS = ("albert", "swav", "scripts", "tests")


def imported_modules(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def offending(paths, forbidden) -> list:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in paths
        for name in sorted(imported_modules(path))
        if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden)
    ]


def core_modules() -> list:
    return [path for path in CORE.rglob("*.py") if TOOLS not in path.parents]


def test_core_imports_no_tool_experiment_script_or_test():
    assert core_modules(), "no core modules found"
    assert offending(core_modules(), FORBIDDEN_IN_CORE) == []


def test_tools_import_the_core_but_no_experiment():
    assert offending(TOOLS.rglob("*.py"), FORBIDDEN_IN_TOOLS) == []


def docstring_nodes(tree: ast.AST) -> set:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def test_core_and_tools_name_no_task_metric():
    """Reports and comparisons show the metrics a task reports: no task's metric name is written in the core."""
    task_metric = re.compile(r"\b(mlm|sop|swav)\b|mlm_|sop_", re.IGNORECASE)
    found = []
    for path in CORE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = docstring_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if task_metric.search(node.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert found == []
