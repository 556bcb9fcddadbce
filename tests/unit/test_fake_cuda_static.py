"""CUDA-only APIs (streams, events, synchronisation, pinned memory, CuPy, kernel launches) appear
in one module only, `operators/device.py`; everything else schedules through its interface."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWNER = REPO / "operators" / "device.py"
SCANNED = ("flowrec", "operators")  # the packages (benchmark scripts in tools/ may synchronise to time)
CUDA_QUERIES = frozenset({"is_available", "device_count", "get_device_name", "get_device_capability"})
CUDA_METHODS = frozenset({"pin_memory", "is_pinned", "record_stream", "cuda"})


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def cuda_api_uses(path: Path) -> list[str]:
    """`file:line: what` for every CUDA-only API used in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        what = ""
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name.startswith("torch.cuda.") and name.split(".")[2] not in CUDA_QUERIES:
                what = name
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CUDA_METHODS:
            what = f".{node.func.attr}()"
        elif isinstance(node, ast.keyword) and node.arg == "pin_memory":
            what = "pin_memory="
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n == "cupy" or n.startswith("cupy.") or n == "torch.cuda" for n in names):
                what = "import of " + ", ".join(n for n in names if n)
        elif isinstance(node, ast.Call) and _dotted(node.func).endswith(("import_module", "__import__")) and any(
                isinstance(a, ast.Constant) and str(a.value).split(".")[0] == "cupy" for a in node.args):
            what = 'dynamic import of "cupy"'
        if what:
            found.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno}: {what}")
    return sorted(set(found))


def test_cuda_only_apis_live_in_operators_device():
    uses = [u for folder in SCANNED for path in sorted((REPO / folder).rglob("*.py")) if path != OWNER
            for u in cuda_api_uses(path)]
    assert uses == [], "CUDA-only APIs outside operators/device.py:\n" + "\n".join(uses)


def test_the_owner_is_where_they_are():
    uses = " ".join(cuda_api_uses(OWNER))
    for api in ("torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.synchronize", ".pin_memory()",
                'dynamic import of "cupy"'):
        assert api in uses


def test_a_planted_stream_is_named_by_file_and_line(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import importlib\nimport torch\n\n\ndef f(t):\n    s = torch.cuda.Stream()\n"
                       "    cp = importlib.import_module('cupy')\n    return t.pin_memory()\n")
    assert cuda_api_uses(planted) == [f"{planted}:6: torch.cuda.Stream", f'{planted}:7: dynamic import of "cupy"',
                                      f"{planted}:8: .pin_memory()"]
