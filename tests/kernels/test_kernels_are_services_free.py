"""kernels/ is a library the services use: no module under it may import a service."""
from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_no_kernel_module_imports_a_service():
    offenders = []
    for path in sorted(KERNELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(KERNELS.parent)}: {n}" for n in names if n.split(".")[0] == "services"]
    assert offenders == []
    assert (KERNELS / "sampling" / "stream.py").exists()  # the sampler is among the modules checked
