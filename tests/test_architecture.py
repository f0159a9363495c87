"""The import direction deploy -> cluster -> workers -> parallel -> kernels, and what each
package may assume about the machine."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["deploy", "cluster", "workers", "parallel", "kernels"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ORDER)
def test_imports_point_one_way(package):
    allowed = set(ORDER[ORDER.index(package) :])
    forbidden = set(ORDER) - allowed
    for path in (ROOT / package).rglob("*.py"):
        bad = _imports(path) & forbidden
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} against the direction"


def test_import_cluster_with_cuda_hidden():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    code = (
        "import cluster, cluster.engine, cluster.scheduler, cluster.async_engine, "
        "cluster.llm, cluster.executor; import torch; assert not torch.cuda.is_available()"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT)


def test_transformers_does_not_take_our_kernels_package_for_the_kernel_hub():
    from importlib.metadata import version

    import transformers.utils

    assert version("mtpserve")
    assert not transformers.utils.is_kernels_available()
