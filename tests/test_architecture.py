"""The package structure stays as docs/architecture.md describes: sub-packages import one way (each only
those below it), no import cycles, no module importing a private name of another, no oversized module,
at most 10 loose modules at the top of logitspec/; the scripts in scripts/ use the project through its
public names only, and every project name they import exists."""
import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 450


def _modules() -> dict[str, pathlib.Path]:
    files = [p for root in ("logitspec", "pipeline") for p in (REPO / root).rglob("*.py")]
    names = {}
    for p in files:
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _imports(name: str, path: pathlib.Path, known) -> list[tuple[str, list[str]]]:
    """(imported module, imported names) of every import in ``path``, resolved to project modules."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            out += [(s, []) for s in subs] or [(target, [a.name for a in node.names])]
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return [(t, ns) for t, ns in out if t in known and t != name]


def test_no_import_cycles_and_no_private_imports():
    mods = _modules()
    graph = {m: set() for m in mods}
    private = []
    for m, p in mods.items():
        for target, names in _imports(m, p, mods):
            graph[m].add(target)
            private += [f"{m}: from {target} import {n}" for n in names if _private(n)]
    assert not private, private

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen))
                   for n in graph[start])

    cycles = [m for m in graph if reaches(m, m, set())]
    assert not cycles, f"modules on an import cycle: {sorted(cycles)}"


# each sub-package imports only those of a lower rank (its own modules aside); the top-level modules
# of logitspec/ and pipeline/ are rank 0, except the entry points, which may import anything
RANKS = {
    "logitspec.bench": 7, "logitspec.engine": 6, "logitspec.worker": 5, "logitspec.sample": 4,
    "logitspec.spec_decode": 3, "logitspec.evaluation": 3, "logitspec.models": 2, "logitspec.kernels": 1,
    "pipeline.sweep": 4, "pipeline.job": 3, "pipeline.replica": 2, "pipeline.io": 1,
}
# (pipeline.data_stage: the Ray Data entry, beside the job's command line)
ENTRY_POINTS = {"logitspec", "logitspec.cli", "pipeline", "pipeline.data_stage"}
# loading a model registers the engine's attention with transformers (the model runs it from then on)
ALLOWED_UPWARD = {("logitspec.models.loading", "logitspec.worker.attention")}
MAX_LOOSE_MODULES = 10


def _group(module: str) -> tuple[str, str]:
    """(root, sub-package or '' for a top-level module) of a project module."""
    parts = module.split(".")
    sub = ".".join(parts[:2])
    return parts[0], sub if sub in RANKS else ""


def _runtime_imports(path: pathlib.Path, name: str, known) -> list[str]:
    """Project modules ``path`` imports, outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    out = []
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out += [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [t for t in out if t in known]


def test_sub_packages_import_one_way():
    mods = _modules()
    wrong = []
    for m, p in mods.items():
        if m in ENTRY_POINTS:
            continue
        root, sub = _group(m)
        rank = RANKS.get(sub, 0)
        for t in _runtime_imports(p, m, mods):
            troot, tsub = _group(t)
            if (troot, tsub) == (root, sub) or (m, t) in ALLOWED_UPWARD:
                continue
            if root == "logitspec" and troot == "pipeline":
                wrong.append(f"{m} imports {t}: the engine knows nothing of the pipeline")
            elif root == troot and RANKS.get(tsub, 0) >= rank:
                wrong.append(f"{m} imports {t}")
    assert not wrong, wrong


def test_the_engine_loop_does_not_import_the_benchmark_tools():
    mods = _modules()
    loop = [m for m in mods
            if m.startswith(("logitspec.engine", "logitspec.sample", "logitspec.spec_decode"))]
    assert "logitspec.engine.session" in loop and "logitspec.sample.acceptance" in loop
    wrong = [f"{m} imports {t}" for m in loop for t in _runtime_imports(mods[m], m, mods)
             if t.startswith("logitspec.bench")]
    assert not wrong, wrong


def test_few_loose_modules_at_the_top():
    loose = sorted(p.name for p in (REPO / "logitspec").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_modules_stay_small():
    big = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big


# private attributes of third-party objects a script may read: transformers' config has no public
# getter for the attention implementation a model runs
THIRD_PARTY_PRIVATE = {"_attn_implementation"}


def _top_level_names(path: pathlib.Path) -> set[str]:
    """Names a module defines or imports at its top level (what ``from module import name`` finds)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):  # optional imports and fallbacks
            names |= {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            names |= {(a.asname or a.name).split(".")[0] for n in ast.walk(node)
                      if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
            names |= {n.id for n in ast.walk(node)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def test_scripts_use_only_public_project_names():
    """A script (what users and the device checks run) imports existing public names of the project and
    reads no private attribute of another module's object (``engine._step``): a script that needs one
    is asking for a public method, or is an experiment that belongs in git history."""
    mods = _modules()
    scripts = sorted((REPO / "scripts").glob("*.py"))
    assert scripts
    problems = []
    for path in scripts:
        where = path.relative_to(REPO)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                root = node.module.split(".")[0]
                if root not in ("logitspec", "pipeline"):
                    continue
                if node.module not in mods:
                    problems.append(f"{where}: imports {node.module}, which does not exist")
                    continue
                defined = _top_level_names(mods[node.module])
                for a in node.names:
                    if _private(a.name):
                        problems.append(f"{where}: from {node.module} import {a.name}")
                    elif a.name != "*" and a.name not in defined and f"{node.module}.{a.name}" not in mods:
                        problems.append(f"{where}: {node.module} has no {a.name}")
            elif isinstance(node, ast.Import):
                problems += [f"{where}: imports {a.name}, which does not exist" for a in node.names
                             if a.name.split(".")[0] in ("logitspec", "pipeline") and a.name not in mods]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if not own and node.attr not in THIRD_PARTY_PRIVATE:
                    problems.append(f"{where}:{node.lineno}: reads .{node.attr} of another object")
    assert not problems, problems
