"""The serving runtime never imports the non-serving code (training, benchmarks, test helpers,
the self-test): those sit on top of the runtime, so they can change without touching what
serves. Read from the source (every import statement, lazy ones inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NON_SERVING = ("bicache_sgl.training", "bicache_sgl.bench", "bicache_sgl.testing", "bicache_sgl.selftest")


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path = ROOT) -> list[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append(mod)
            out += [f"{mod}.{a.name}" for a in node.names]  # ``from pkg import submodule``
    return out


def _is_non_serving(mod: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in NON_SERVING)


def _runtime_files() -> list[Path]:
    files = sorted((ROOT / "bicache_sgl").rglob("*.py")) + sorted((ROOT / "radix").rglob("*.py"))
    return [f for f in files if not _is_non_serving(_module_name(f))]


def test_the_runtime_imports_no_training_benchmark_or_test_code():
    files = _runtime_files()
    assert len(files) > 50  # the whole runtime was read
    bad = [(_module_name(f), m) for f in files for m in _imports(f) if _is_non_serving(m)]
    assert not bad, f"runtime modules importing non-serving code: {bad}"


def test_the_check_sees_a_lazy_relative_import(tmp_path):
    """The reader resolves ``from ..testing.planted import x`` inside a function, as the runtime
    would write it: without this the test above could pass by reading nothing."""
    probe = tmp_path / "bicache_sgl" / "engine" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("def f():\n    from ..testing.planted import make_planted_llada\n    return make_planted_llada\n")
    found = _imports(probe, tmp_path)
    assert "bicache_sgl.testing.planted" in found and any(_is_non_serving(m) for m in found)
    init = tmp_path / "bicache_sgl" / "__init__.py"
    init.write_text("from .bench import fewshot\n")
    assert "bicache_sgl.bench" in _imports(init, tmp_path)
