"""The dependency rules of DESIGN.md, checked on the source, and the CLI without torch."""

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, write

HEAVY = {"torch", "diffusers", "transformers", "accelerate", "safetensors"}
# The only modules that may import the heavy libraries, and then only lazily or as GPU code.
GPU_MODULES = {"workers/pipelines.py", "workers/tiny.py"}


def imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported at module level?) for every import in a file."""
    tree = ast.parse(path.read_text())
    top_level = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        found += [(name.split(".")[0], id(node) in top_level) for name in names]
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_models_import_no_other_layer_and_nothing_heavy() -> None:
    for path in sources("models"):
        used = {name for name, _ in imports(path)}
        assert not used & ({"producer", "workers", "migrations", "celery"} | HEAVY), path


def test_producer_imports_only_models_and_the_celery_app() -> None:
    for path in sources("producer"):
        for name, _ in imports(path):
            assert name not in HEAVY, path
        tree_text = path.read_text()
        for forbidden in ("workers.generate", "workers.pipelines", "workers.tiny"):
            assert forbidden not in tree_text, f"{path} imports {forbidden}"


def test_heavy_libraries_only_in_gpu_modules() -> None:
    for package in ("workers", "producer", "models", "migrations"):
        for path in sources(package):
            relative = path.relative_to(ROOT).as_posix()
            heavy_at_top = [name for name, top in imports(path) if top and name in HEAVY]
            if relative not in GPU_MODULES:
                assert not heavy_at_top, f"{relative} imports {heavy_at_top} at module level"


BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "diffusers", "transformers"}:
            raise ImportError(f"{name} is blocked: the producer must not need it")
sys.meta_path.insert(0, Block())
from producer.cli import main
main()
"""


def test_submit_works_without_torch(service_env: dict[str, str], tmp_path: Path) -> None:
    prompts = write(tmp_path / "p.csv", "prompt,seed\nno torch needed here,1\n")
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, "submit", str(prompts), "--json"],
        env=service_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert '"jobs": 1' in done.stdout


def test_workers_main_loads_without_torch() -> None:
    probe = "import sys, workers.main, workers.tasks; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True, timeout=60)
