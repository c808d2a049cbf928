"""What users read when they ask for help or get something wrong: every script's --help works and says where
the config keys are listed, and every config key an error message names exists."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import typing
from pathlib import Path

import pytest

from common.config import RunConfig
from tests.helpers import ROOT

SCRIPTS = sorted(
    str(path.relative_to(ROOT))
    for path in [*ROOT.glob("scripts/*.py"), *ROOT.glob("scripts/experiments/*.py")]
    if not path.name.startswith("_")
)
SOURCES = [path for folder in ("common", "albert", "swav", "scripts") for path in (ROOT / folder).rglob("*.py")]
EXPERIMENTS = ("albert", "swav")
KEY = re.compile(r"\b(network|collaboration|training|monitor|debug|task)\.([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_has_help_that_points_to_the_config_keys(script, preloaded_script):
    result = preloaded_script(script, "--help", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    if "--config" in result.stdout:
        assert "common/config.py" in result.stdout, f"{script} --help does not say where config keys are listed"


def _fields(schema) -> dict:
    hints = typing.get_type_hints(schema)
    return {field.name: hints[field.name] for field in dataclasses.fields(schema)}


def _key_exists(schema, parts) -> bool:
    if not parts:
        return True
    fields = _fields(schema)
    if parts[0] not in fields:
        return False
    kind = fields[parts[0]]
    inner = [arg for arg in typing.get_args(kind) if dataclasses.is_dataclass(arg)]  # Optional[SomeConfig]
    nested = kind if dataclasses.is_dataclass(kind) else (inner[0] if inner else None)
    return _key_exists(nested, parts[1:]) if nested is not None else len(parts) == 1


def _schema_has(key: str, experiments) -> bool:
    """``task.*`` keys are checked against the experiments the message can come from (its own package's; any
    experiment's for shared code)."""
    section, *rest = key.split(".")
    if section == "task":
        return any(_key_exists(importlib.import_module(f"{name}.task").TaskConfig, rest) for name in experiments)
    return _key_exists(_fields(RunConfig)[section], rest)


def _error_texts(path: Path):
    """String pieces inside ``raise`` statements and ``require(...)`` checks (f-strings included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        is_require = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require"
        if isinstance(node, ast.Raise) or is_require:
            for inner in ast.walk(node):
                if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                    yield inner.lineno, inner.value


def test_every_config_key_named_in_an_error_message_exists():
    named, missing = set(), []
    for path in SOURCES:
        package = path.relative_to(ROOT).parts[0]
        experiments = [package] if package in EXPERIMENTS else EXPERIMENTS
        for line, text in _error_texts(path):
            for match in KEY.finditer(text):
                key = match.group(0).rstrip(".")
                if key.endswith((".py", ".yaml")):  # a file name such as task.py, not a key
                    continue
                named.add(key)
                if not _schema_has(key, experiments):
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {key}")
    assert len(named) > 20, sorted(named)  # the walk really finds the keys messages name
    assert not missing, "error messages name keys that do not exist:\n" + "\n".join(missing)
