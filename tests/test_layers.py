"""The direction of imports: the library never imports the application (read from the source, with ast).

The library is every module of ``mlxevict/`` except the application's: the command
line (``cli``, ``commands``), the generation loop and chat session (``generate``,
``prompts``, ``chat_session``), model resolution (``resolve``, ``family``,
``demo_model``, ``gguf_cache``, ``folder_check``), and the folders installed as ``mlxevict.app``, ``mlxevict.convert``
and ``mlxevict.benchmarks``. Imports inside functions count too: a lazy import is
still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlxevict"
APPLICATION = (
    "cli", "commands", "generate", "prompts", "chat_session", "resolve", "family", "demo_model",
    "gguf_cache", "folder_check", "server", "launch", "app", "convert", "benchmarks",
)  # fmt: skip
TOP_LEVEL_FOLDERS = ("app", "convert", "benchmarks")  # where the installed mlxevict.app/... live in the checkout


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[str]:
    """Absolute names of every module ``source`` (the text of ``module``) imports, relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]  # "from . import generate"
    return names


def application_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of ``source`` that reach the application (see the module docstring)."""
    bad = []
    for name in imported_modules(source, module, is_package):
        parts = name.split(".")
        if parts[0] == "mlxevict" and len(parts) > 1 and parts[1] in APPLICATION:
            bad.append(name)
        elif parts[0] in TOP_LEVEL_FOLDERS:
            bad.append(name)
    return sorted(set(bad))


def library_modules() -> list[Path]:
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = module_name(path).split(".")
        if len(parts) > 1 and parts[1] in APPLICATION:
            continue
        files.append(path)
    return files


def test_the_library_is_found():
    names = {module_name(p) for p in library_modules()}
    assert {"mlxevict", "mlxevict.cache", "mlxevict.make", "mlxevict.plan", "mlxevict.policies.entropy"} <= names
    assert not names & {"mlxevict.cli", "mlxevict.generate", "mlxevict.commands.common"}


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: module_name(p))
def test_the_library_never_imports_the_application(path):
    source = path.read_text()
    assert application_imports(source, module_name(path), path.name == "__init__.py") == []


@pytest.mark.parametrize(
    "source",
    [
        "from .app.main import run_chat_app",
        "from mlxevict.app import main",
        "import mlxevict.convert",
        "from . import generate",
        "def later():\n    from .commands.common import load\n",
        "from benchmarks import caches",
        "from ..resolve import resolve_model",
    ],
)
def test_the_check_catches_an_application_import(source):
    module = "mlxevict.policies.entropy" if source.startswith("from ..") else "mlxevict.cache"
    assert application_imports(source, module) != []


def test_the_check_lets_library_imports_pass():
    source = "from .kernels import x\nfrom . import stats\nimport mlx.core as mx\nfrom mlx_lm.generate import generate_step"
    assert application_imports(source, "mlxevict.cache") == []
    assert application_imports("from .base import Policy", "mlxevict.policies", is_package=True) == []
