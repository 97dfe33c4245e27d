"""The package structure stays as docs/architecture.md describes: no import cycles, no module importing
a private name of another, no oversized module in logitspec/ or pipeline/."""
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
            private += [f"{m}: from {target} import {n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert not private, private

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in graph[start])

    cycles = [m for m in graph if reaches(m, m, set())]
    assert not cycles, f"modules on an import cycle: {sorted(cycles)}"


def test_modules_stay_small():
    big = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big
