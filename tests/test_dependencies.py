"""The dependency rules of DESIGN.md, checked on the source and in running processes."""

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT, WorkerProcess, write
from tests.services import wait_for

HEAVY = {"torch", "diffusers", "transformers", "accelerate", "safetensors"}
# Parts of them that load no framework (importing safetensors' NumPy API leaves torch out):
# the producer writes the tiny scoring heads with it.
LIGHT = {"safetensors.numpy"}
# The only modules that may import the heavy libraries, and then only lazily or as GPU code.
GPU_MODULES = {
    "workers/gpu.py",
    "workers/tiny.py",
    "workers/compiled.py",
    "workers/generate/pipelines.py",
    "workers/generate/loras.py",
    "workers/generate/conditioning.py",
    "workers/generate/shared_prompts.py",
    "workers/encode/batches.py",
    "workers/encode/encoders.py",
    "workers/curate/heads.py",
    "workers/curate/scoring.py",
    "workers/evaluate/inception.py",
    "workers/evaluate/metrics.py",
    "workers/train/loop/build.py",
    "workers/train/loop/checkpoints.py",
    "workers/train/loop/compiled.py",
    "workers/train/loop/files.py",
    "workers/train/loop/lora.py",
    "workers/train/loop/sharding.py",
    "workers/train/loop/state.py",
    "workers/train/loop/step.py",
    "workers/train/loop/training.py",
    "workers/train/ranks/serve.py",
    "workers/train/plan.py",
}
PACKAGES = ("producer", "workers", "models", "migrations")


def imports(path: Path) -> list[tuple[str, bool]]:
    """(name, imported at module level?) for every absolute import in a file, each by its
    whole dotted name, `from a.b import c` as `a.b.c` (a module or a name in one: the graph
    below tells which): every internal one starts with `sdq.`, so the layer it belongs to
    is in the second part."""
    tree = ast.parse(path.read_text())
    top_level = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(name, id(node) in top_level) for name in names]
    return found


def within(module: str, packages: set[str]) -> bool:
    """Whether a dotted module name is one of the packages or inside one of them."""
    return any(module == package or module.startswith(f"{package}.") for package in packages)


def heavy(module: str) -> bool:
    return within(module, HEAVY) and not within(module, LIGHT)


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


MODELS_MUST_NOT_IMPORT = {"sdq.producer", "sdq.workers", "sdq.migrations", "celery"}
# The producer talks to workers through the Celery app alone, and names the remote-control
# command the workers answer for `sdq metrics`; each kind's work is the workers' own.
PRODUCER_MAY_IMPORT = {"sdq.workers.app", "sdq.workers.memory"}


def forbidden_in_models(path: Path) -> list[str]:
    return [name for name, _ in imports(path)
            if within(name, MODELS_MUST_NOT_IMPORT) or heavy(name)]  # fmt: skip


def forbidden_in_producer(path: Path) -> list[str]:
    return [
        name
        for name, _ in imports(path)
        if heavy(name) or (within(name, {"sdq.workers"}) and not within(name, PRODUCER_MAY_IMPORT))
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
        "sdq.workers.app.SdqCelery",
        "sdq.migrations.env",
        "sdq.workers.train.work.TrainWork",
        "torch.nn",
    ]
    assert forbidden_in_producer(module) == ["sdq.workers.train.work.TrainWork", "torch.nn"]
    assert imports(module)[0] == ("sdq.workers.app.SdqCelery", True)
    assert imports(module)[3] == ("sdq.workers.train.work.TrainWork", False)


SIDES = ("producer", "workers", "models")


def generic_modules() -> list[Path]:
    """Every product module outside the kinds' folders (`<side>/<kind>/`), but the table of
    kinds itself, the one place a kind is registered."""
    from sdq.models.jobs.kinds import KINDS

    return [
        path
        for side in SIDES
        for path in sources(side)
        if path.relative_to(ROOT).parts[1] not in KINDS
        and path.relative_to(ROOT).as_posix() != "models/jobs/kinds.py"
    ]


def kind_relations() -> set[str]:
    """The tables and views of every kind's own `tables` module."""
    from importlib import import_module

    from sqlalchemy.sql import TableClause

    from sdq.models.jobs.kinds import KINDS

    relations = set()
    for kind in KINDS:
        path = ROOT / "models" / kind / "tables.py"
        if path.is_file():
            module = import_module(f"sdq.models.{kind}.tables")
            for value in vars(module).values():
                if isinstance(value, TableClause) and value.name:
                    relations.add(value.name)
                elif getattr(value, "__module__", None) == module.__name__:
                    relations.add(getattr(value, "__tablename__", None))
    return relations - {None}


def words(text: str) -> set[str]:
    """The lower-case words of an identifier or a string: snake_case, CamelCase, --options."""
    return {word.lower() for word in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", text)}


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstrings' nodes: words for people, not for the program."""
    bodies = [tree, *(n for n in ast.walk(tree) if isinstance(n, DEFINITIONS))]
    return {
        id(body.body[0].value)
        for body in bodies
        if body.body and isinstance(body.body[0], ast.Expr)
        and isinstance(body.body[0].value, ast.Constant)
    }  # fmt: skip


DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def kinds_named(path: Path, relations: set[str] | None = None) -> list[str]:
    """The kinds a module names: by importing a kind's own module or its row's constant; by
    a string that is a kind's name or queue, an option (`--train-ranks`) or SQL naming a
    kind's table or view (`relations`); or by an identifier it defines or reads
    (`train_ranks`, `TrainSettings`, `settings.train`)."""
    from sdq.models.jobs.kinds import KINDS

    kind_packages = {f"sdq.{side}.{kind}" for side in SIDES for kind in KINDS}
    constants = {kind.upper() for kind in KINDS}
    names = {word for kind in KINDS.values() for word in (kind.name, kind.queue)}
    relations = kind_relations() if relations is None else relations
    tree = ast.parse(path.read_text())
    prose = docstrings(tree)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    named = [module for module, _ in imports(path) if within(module, kind_packages)]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            named += [alias.name for alias in node.names if alias.name in constants]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = "" if id(node) in prose else node.value
            if text in names or (text.startswith("--") and words(text) & set(KINDS)):
                named.append(repr(text))
            named += [repr(table) for table in relations if re.search(rf"\b{table}\b", text)]
        named += [
            identifier
            for identifier in _identifiers(node, called)
            if words(identifier) & set(KINDS)
        ]
    return named


def _identifiers(node: ast.AST, called: set[int]) -> list[str]:
    """The names a node defines or reads: a definition's, an argument's, a variable's, a
    keyword's, an attribute's (not a method called: `text.encode()`). A library's names it
    only reads are the library's (`hf_hub_download`)."""
    if isinstance(node, DEFINITIONS):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return [node.id]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    if isinstance(node, ast.Attribute) and id(node) not in called:
        # A method taken off a new object (`JSONEncoder(...).encode`) is the object's.
        return [] if isinstance(node.value, ast.Call) else [node.attr]
    return []


def test_generic_modules_never_name_a_kind(tmp_path: Path) -> None:
    relations = kind_relations()
    assert {"generations", "train_steps", "sample_quality"} <= relations
    modules = generic_modules()
    # Derived, not listed: the shared nouns' rooms are generic too.
    shared = {"producer/display.py", "producer/datasets/lookups.py", "workers/shards/latents.py"}
    assert shared <= {path.relative_to(ROOT).as_posix() for path in modules}
    for path in modules:
        named = kinds_named(path, relations)
        assert not named, f"{path.relative_to(ROOT)} names {named}"
    # The guard itself sees each way of naming one.
    module = write(
        tmp_path / "naming.py",
        '"""A docstring may say train, generations and curate."""\n'
        "from sdq.models.jobs.kinds import TRAIN, KINDS\n"
        "from sdq.producer.generate.cli import report_run\n"
        "def later(train_ranks, settings):\n"
        "    settings.download.threads\n"
        "    option('--encode-batch')\n"
        "    text.encode()\n"
        "    query = 'SELECT count(*) FROM train_steps'\n"
        "    return KINDS['encode']\n",
    )
    assert kinds_named(module, relations) == [
        "sdq.producer.generate.cli.report_run",
        "TRAIN",
        "train_ranks",
        "'train_steps'",
        "download",
        "'--encode-batch'",
        "'encode'",
    ]


HOOK_TYPES = {"producer": "ProducerHooks", "models": "ModelHooks", "workers": "WorkerHooks"}


def test_each_kind_declares_its_hooks_in_one_typed_place(tmp_path: Path) -> None:
    """A kind's hooks are fields of its side's HOOKS (models/jobs/kinds.py): a misspelt one
    fails as the kind loads, and a function named as a hook that its HOOKS does not hold
    (defined, never declared) is refused here."""
    from dataclasses import fields
    from importlib import import_module

    from sdq.models.jobs import kinds

    for kind in kinds.KINDS.values():
        declared = {"producer": kind.producer_hooks(), "models": kind.model_hooks(),
                    "workers": kind.worker_hooks()}  # fmt: skip
        assert declared["producer"].commands, f"{kind.name} has no commands"
        for side, hooks in declared.items():
            assert type(hooks).__name__ == HOOK_TYPES[side]
            hook_names = {field.name for field in fields(hooks)}
            held = {id(getattr(hooks, name)) for name in hook_names}
            for path in sources(f"{side}/{kind.name}"):
                module = import_module(
                    ".".join(["sdq", *path.relative_to(ROOT).with_suffix("").parts])
                )
                named_as_hooks = [
                    name for name in hook_names & set(vars(module))
                    if callable(getattr(module, name)) and id(getattr(module, name)) not in held
                ]  # fmt: skip
                assert not named_as_hooks, f"{path}: {named_as_hooks} not in its HOOKS"
    # A hook under a name its side does not have is refused as the module loads.
    with pytest.raises(TypeError, match="at_run_ends"):
        kinds.WorkerHooks(at_run_ends=print)
    package = tmp_path / "sdq_fake_hooks"
    package.mkdir()
    write(package / "__init__.py", "")
    write(package / "hooks.py", "from sdq.models.jobs.kinds import ModelHooks\nHOOKS = 3\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(TypeError, match="not WorkerHooks"):
            kinds._hooks("sdq_fake_hooks.hooks", kinds.WorkerHooks)
    finally:
        sys.path.remove(str(tmp_path))


# Where a kind stands on another, and why: a train run's validation renders are generation
# runs (training writes their jobs and shows their images), and its checkpoints are scored
# by evaluate jobs it writes as they come; an evaluation's renders are generation runs and
# its CLIP scores curate's.
STANDS_ON = {("train", "generate"), ("train", "evaluate"), ("evaluate", "generate"),
             ("evaluate", "curate")}  # fmt: skip


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


def product_modules() -> dict[str, Path]:
    """Each of sdq's modules by its dotted name, as installed."""
    return {
        ".".join(["sdq", package, *path.relative_to(ROOT / package).with_suffix("").parts])
        .removesuffix(".__init__"): path
        for package in PACKAGES
        for path in sources(package)
    }  # fmt: skip


def module_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module -> the modules it imports, anywhere in it: `from sdq.models.db import x`
    is sdq.models.db, `from sdq.workers.train import gang` is sdq.workers.train.gang."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph[module] = set()
        for name, _ in imports(path):
            while name and name not in modules:
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


def test_no_module_imports_itself_through_others(tmp_path: Path) -> None:
    assert circles(module_graph(product_modules())) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    # A module imported from its package (`from pkg import b`) closes a circle too.
    one = write(tmp_path / "a.py", "from pkg import b\n")
    other = write(tmp_path / "b.py", "def later():\n    from pkg.a import x\n")
    assert circles(module_graph({"pkg.a": one, "pkg.b": other})) == [{"pkg.a", "pkg.b"}]


def test_heavy_libraries_only_in_gpu_modules() -> None:
    for package in PACKAGES:
        for path in sources(package):
            relative = path.relative_to(ROOT).as_posix()
            heavy_at_top = [name for name, top in imports(path) if top and heavy(name)]
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
