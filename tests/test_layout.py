"""The package's layout as the README draws it: five layers that import only downward, no import cycles, no private
name imported from another module, modules of about 400 lines at most, a core free of Lightning, Hydra, W&B and files,
and a public API at the top level."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "lmcal"

# Each part of the package and the parts it may import (besides itself). The entry points (lmcal.<name>) sit on top.
LAYERS = {
    "errors": set(), "paper": set(), "utils": {"errors"},
    "data": {"errors"},
    "models": {"data", "errors", "utils"},
    "core": {"models", "data", "errors", "utils"},
    "stages": {"core", "models", "data", "errors", "utils", "paper"},
    "training": {"stages", "core", "models", "data", "errors", "utils"},
    "reporting": {"stages", "core", "models", "data", "errors", "utils", "paper"},
    "pipeline": {"training", "reporting", "stages", "core", "models", "data", "errors", "utils", "paper"},
}
ENTRY_POINTS = {"train", "evaluate", "reproduce", "report", "docs"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def imports(name: str) -> list[tuple[str, list[str], int]]:
    """(imported lmcal module, names taken from it, line) of every import in module `name`, lazy ones too."""
    out = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "lmcal"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "lmcal":
            for a in node.names:  # `from lmcal.x import y` imports the module lmcal.x.y where there is one
                sub = f"{node.module}.{a.name}"
                out.append((sub, [], node.lineno) if sub in MODULES else (node.module, [a.name], node.lineno))
    return out


def part(name: str) -> str:
    """The layer of a module: lmcal.core.memory -> core; an entry point -> its own name."""
    bits = name.split(".")
    return bits[1] if len(bits) > 1 else "lmcal"


def graph() -> dict[str, set[str]]:
    return {m: {i for i, _, _ in imports(m) if i in MODULES and i != m} for m in MODULES}


def test_every_import_goes_down_the_layers():
    wrong = []
    for m in MODULES:
        p = part(m)
        if p == "lmcal" or m.split(".")[1] in ENTRY_POINTS:
            continue  # lmcal/__init__ (lazy) and the entry points sit on top of everything
        for i, _, line in imports(m):
            q = part(i)
            if q != p and q not in LAYERS[p]:
                wrong.append(f"{m}:{line} imports {i} ({p} may import {sorted(LAYERS[p]) or 'nothing of lmcal'})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    g, state, cycles = graph(), {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(g[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join([*path[path.index(d):], d]))
            elif d not in state:
                visit(d, [*path, d])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_no_module_imports_a_private_name_of_another():
    found = [f"{m}:{line} takes {n} from {i}" for m in MODULES for i, names, line in imports(m) for n in names
             if n.startswith("_") and i != m]
    assert not found, "\n".join(found)


def test_no_module_is_much_over_400_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long


def test_the_core_runs_without_lightning_hydra_wandb_or_files():
    """Importing every core module pulls in none of the frameworks, and no core module opens or writes files."""
    core = sorted(m for m in MODULES if part(m) == "core")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in core) +
            "bad = [m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning', 'hydra', "
            "'omegaconf', 'wandb', 'matplotlib')]\nprint(sorted(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=SRC.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    for m in core:
        text = MODULES[m].read_text()
        for call in ("open(", ".write_text(", ".read_text(", "json.dump", "torch.save(", "torch.load("):
            assert call not in text, f"{m} does file I/O ({call})"


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_entry_points_stay_where_the_readme_runs_them(entry):
    assert f"lmcal.{entry}" in MODULES
    assert 'if __name__ == "__main__":' in MODULES[f"lmcal.{entry}"].read_text()


def test_the_public_api_resolves_lazily():
    """`from lmcal import X` for every public name; `import lmcal` alone loads no torch (the entry points start
    fast)."""
    code = ("import sys, lmcal\nassert 'torch' not in sys.modules, 'import lmcal loaded torch'\n"
            "missing = [n for n in lmcal.__all__ if getattr(lmcal, n, None) is None]\nprint(missing)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=SRC.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    import lmcal

    for name in ("LSTMStepLM", "HFCausalLM", "generation_entropy_curve", "fit_lookahead_calibration", "calibrated",
                 "memory_upper_bound", "context_rows", "make_decoder", "load_hf_model", "MarkovOracle",
                 "DriftingOracle", "DelayedDriftOracle"):
        assert name in lmcal.__all__


def test_the_readme_python_examples_run():
    """Every Python example of the README that imports from `lmcal` itself runs as printed."""
    readme = (SRC.parent / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    examples = [b for b in blocks if "from lmcal import" in b]
    assert examples
    for code in examples:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=SRC.parent, timeout=120)
        assert out.returncode == 0, out.stderr
