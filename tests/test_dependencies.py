"""The dependency rules of DESIGN.md, checked on the source and in running processes."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.conftest import ROOT, WorkerProcess, write
from tests.services import wait_for

HEAVY = {"torch", "diffusers", "transformers", "accelerate", "safetensors"}
# The only modules that may import the heavy libraries, and then only lazily or as GPU code.
GPU_MODULES = {
    "workers/gpu.py",
    "workers/tiny.py",
    "workers/generate/pipelines.py",
    "workers/generate/conditioning.py",
    "workers/generate/shared_prompts.py",
    "workers/encode/encoders.py",
    "workers/curate/heads.py",
    "workers/curate/scoring.py",
    "workers/train/loop/build.py",
    "workers/train/loop/checkpoints.py",
    "workers/train/loop/files.py",
    "workers/train/loop/sharding.py",
    "workers/train/loop/state.py",
    "workers/train/loop/step.py",
    "workers/train/loop/training.py",
    "workers/train/ranks/serve.py",
    "workers/train/plan.py",
}
PACKAGES = ("producer", "workers", "models", "migrations")


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module, imported at module level?) for every absolute import in a file, the module
    by its whole dotted name: every internal one starts with `sdq.`, so the layer it belongs
    to is in the second part."""
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
        found += [(name, id(node) in top_level) for name in names]
    return found


def within(module: str, packages: set[str]) -> bool:
    """Whether a dotted module name is one of the packages or inside one of them."""
    return any(module == package or module.startswith(f"{package}.") for package in packages)


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


MODELS_MUST_NOT_IMPORT = {"sdq.producer", "sdq.workers", "sdq.migrations", "celery"} | HEAVY
# The producer talks to workers through the Celery app alone, and names the remote-control
# command the workers answer for `sdq metrics`; each kind's work is the workers' own.
PRODUCER_MAY_IMPORT = {"sdq.workers.app", "sdq.workers.memory"}


def forbidden_in_models(path: Path) -> list[str]:
    return [name for name, _ in imports(path) if within(name, MODELS_MUST_NOT_IMPORT)]


def forbidden_in_producer(path: Path) -> list[str]:
    return [
        name
        for name, _ in imports(path)
        if within(name, HEAVY)
        or (within(name, {"sdq.workers"}) and not within(name, PRODUCER_MAY_IMPORT))
    ]


def test_models_import_no_other_layer_and_nothing_heavy() -> None:
    for path in sources("models"):
        assert not forbidden_in_models(path), path


def test_producer_imports_only_models_and_the_celery_app() -> None:
    for path in sources("producer"):
        assert not forbidden_in_producer(path), path


def test_the_layer_guards_see_internal_imports(tmp_path: Path) -> None:
    # The guards above must fail on what they forbid, at module level or inside a function.
    module = write(
        tmp_path / "layered.py",
        "from sdq.workers.app import SdqCelery\n"
        "import sdq.migrations.env\n"
        "from sdq.models.db import make_engine\n"
        "def later():\n"
        "    from sdq.workers.train.work import TrainWork\n"
        "    import torch.nn\n",
    )
    assert forbidden_in_models(module) == [
        "sdq.workers.app",
        "sdq.migrations.env",
        "sdq.workers.train.work",
        "torch.nn",
    ]
    assert forbidden_in_producer(module) == ["sdq.workers.train.work", "torch.nn"]
    assert imports(module)[0] == ("sdq.workers.app", True)
    assert imports(module)[3] == ("sdq.workers.train.work", False)


# The generic layers: a kind is found from its row (models/jobs/kinds.py), never named here.
# models/ outside the kinds' folders holds the shared nouns (datasets, the registry, the
# store) and the kind-neutral tables.
GENERIC_MODULES = (
    *(path for path in sources("models/jobs") if path.name != "kinds.py"),
    *sorted((ROOT / "models").glob("*.py")),
    *sources("models/tables"),
    *sources("producer/cli"),
    *(ROOT / "producer" / name for name in ("kinds.py", "lookups.py", "launch.py", "metrics.py")),
    *(ROOT / "workers" / name for name in ("app.py", "main.py", "maintenance.py", "delivery.py")),
)


def kinds_named(path: Path) -> list[str]:
    """The kinds a module names: by importing a kind's own module or its row's constant, or
    by a string that is a kind's name or queue."""
    from sdq.models.jobs.kinds import KINDS

    sides = ("producer", "workers", "models")
    kind_packages = {f"sdq.{side}.{kind}" for side in sides for kind in KINDS}
    constants = {kind.upper() for kind in KINDS}
    names = {word for kind in KINDS.values() for word in (kind.name, kind.queue)}
    tree = ast.parse(path.read_text())
    named = [module for module, _ in imports(path) if within(module, kind_packages)]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            named += [alias.name for alias in node.names if alias.name in constants]
        elif isinstance(node, ast.Constant) and node.value in names:
            named.append(repr(node.value))
    return named


def test_generic_modules_never_name_a_kind(tmp_path: Path) -> None:
    for path in GENERIC_MODULES:
        assert not kinds_named(path), f"{path.relative_to(ROOT)} names {kinds_named(path)}"
    # The guard itself sees each way of naming one.
    module = write(
        tmp_path / "naming.py",
        "from sdq.models.jobs.kinds import TRAIN, KINDS\n"
        "from sdq.producer.generate.cli import report_run\n"
        "def later():\n"
        "    return KINDS['encode']\n",
    )
    assert kinds_named(module) == ["sdq.producer.generate.cli", "TRAIN", "'encode'"]


# A train run's validation renders are generation runs: training writes their jobs and
# shows their images, the one kind that stands on another.
STANDS_ON = {("train", "generate")}


def test_kind_folders_never_import_one_another() -> None:
    """A kind stands on the generic layers and the shared nouns (producer/datasets/,
    producer/prompts.py, workers/shards/, models/ outside the kinds' folders) alone, never
    on another kind's folder on any side, but where STANDS_ON says why."""
    from sdq.models.jobs.kinds import KINDS

    sides = ("producer", "workers", "models")
    for kind in KINDS:
        others = {
            f"sdq.{side}.{other}"
            for side in sides
            for other in KINDS
            if other != kind and (kind, other) not in STANDS_ON
        }
        for side in sides:
            for path in sources(f"{side}/{kind}"):
                reached = [module for module, _ in imports(path) if within(module, others)]
                assert not reached, f"{path.relative_to(ROOT)} imports {reached}"


def module_graph() -> dict[str, set[str]]:
    """Each of sdq's modules -> the sdq modules it imports, anywhere in it."""
    modules = {
        ".".join(["sdq", package, *path.relative_to(ROOT / package).with_suffix("").parts])
        .removesuffix(".__init__"): path
        for package in PACKAGES
        for path in sources(package)
    }  # fmt: skip
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph[module] = set()
        for name, _ in imports(path):
            while name and name not in modules:  # `from sdq.models.db import x` -> sdq.models.db
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that reach one another (more than one module each)."""
    reach = {module: set() for module in graph}
    for module in graph:
        frontier = list(graph[module])
        while frontier:
            found = frontier.pop()
            if found not in reach[module]:
                reach[module].add(found)
                frontier += graph.get(found, ())
    groups = {frozenset({m} | {o for o in reach[m] if m in reach[o]}) for m in graph}
    return [set(group) for group in groups if len(group) > 1]


def test_no_module_imports_itself_through_others() -> None:
    assert circles(module_graph()) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_heavy_libraries_only_in_gpu_modules() -> None:
    for package in PACKAGES:
        for path in sources(package):
            relative = path.relative_to(ROOT).as_posix()
            heavy_at_top = [name for name, top in imports(path) if top and within(name, HEAVY)]
            if relative not in GPU_MODULES:
                assert not heavy_at_top, f"{relative} imports {heavy_at_top} at module level"


BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "diffusers", "transformers"}:
            raise ImportError(f"{name} is blocked: the producer must not need it")
sys.meta_path.insert(0, Block())
from sdq.producer.cli.main import main
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


def test_the_command_line_starts_without_pyarrow() -> None:
    # Every `sdq` command starts by loading the whole command tree; pyarrow and numpy, a
    # tenth of a second of it, load only with the commands that read or write parquet.
    probe = (
        "import sys; import sdq.producer.cli.main; "
        "assert not {'pyarrow', 'numpy'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True, timeout=60)


def test_the_celery_app_and_every_task_load_without_torch() -> None:
    probe = (
        "import sys; from sdq.workers.main import app; app.loader.import_default_modules(); "
        "assert 'sdq.generate' in app.tasks; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True, timeout=60)


def loads_torch(pid: int) -> bool:
    """Whether a live process has torch's shared library mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in maps


def test_a_cpu_worker_never_imports_torch(service_env: dict[str, str], tmp_path: Path) -> None:
    process = WorkerProcess(service_env, tmp_path / "cpu.log", pool="cpu").start()
    try:
        wait_for(lambda: len(process.children()) >= 3, what="the cpu pool's processes")
        pids = process.children()
        assert pids and not any(loads_torch(pid) for pid in pids)
    finally:
        process.stop()


def test_the_torch_probe_sees_a_process_that_imports_torch() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        assert loads_torch(child.pid)
    finally:
        child.kill()
        child.wait()


def test_every_package_installs_under_the_sdq_namespace() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {
        "sdq." + init.parent.relative_to(ROOT).as_posix().replace("/", ".")
        for package in PACKAGES
        for init in (ROOT / package).rglob("__init__.py")
    }
    assert listed == on_disk
    # From outside the checkout, only the namespace is importable, not its folders' names.
    probe = (
        "import importlib.util as u; import sdq.models, sdq.workers; "
        "assert u.find_spec('models') is None and u.find_spec('workers') is None"
    )
    subprocess.run([sys.executable, "-c", probe], cwd="/", check=True, timeout=60)
    # The console script the distribution installs runs from anywhere.
    script = Path(sys.executable).with_name("sdq")
    done = subprocess.run([script, "--help"], cwd="/", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "submit" in done.stdout and "requeue" in done.stdout


def test_celery_tasks_stay_thin() -> None:
    """A task reads its message and hands the work to plain functions: ten lines at most."""
    tasks = []
    for path in sources("workers"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                "shared_task" in ast.unparse(decorator) for decorator in node.decorator_list
            ):
                body = node.body[1:] if ast.get_docstring(node) else node.body
                tasks.append((path.name, node.name, body[-1].end_lineno - body[0].lineno + 1))
    assert len(tasks) >= 9  # every kind's, train's join and beat's
    assert [task for task in tasks if task[2] > 10] == []
