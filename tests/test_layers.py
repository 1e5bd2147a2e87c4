"""Imports point one way, read from the code with `ast` (every import, including those inside functions): the
kernel (async_rl/) imports no role and not the launch layer; a role (rollout/, replay/, learner/) imports only the
kernel and itself; no import cycle runs among the product's modules; below the replay's and the rollout side's
entries no component takes the run's config (each takes its own settings); and the kernel takes values, not the
config."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
KERNEL, ROLES, LAUNCH = "async_rl", ("rollout", "replay", "learner"), "launch"
PACKAGES = (KERNEL, *ROLES, LAUNCH)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_files() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


class Import(NamedTuple):
    line: int
    text: str  # as written: `from a.b import c` or `import a.b`
    names: tuple[str, ...]  # what it may name: `a.b.c` (a module, or a name in a.b) and `a.b`


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import of a product module in the file, wherever it is (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    found.append(Import(node.lineno, f"import {alias.name}", (alias.name,)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] in PACKAGES:
                names = tuple(f"{base}.{alias.name}" for alias in node.names) + (base,)
                text = f"from {base} import {', '.join(alias.name for alias in node.names)}"
                found.append(Import(node.lineno, text, names))
    return found


def resolve(name: str, modules: set[str]) -> str | None:
    """The product module an imported name lands in: itself, or the longest module prefix (`a.b.func` -> `a.b`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def layer_violations(allowed: Callable[[str, str], bool]) -> list[str]:
    """`file:line: import ...` for each import whose top-level package `allowed(importer's, imported's)` refuses."""
    return [f"{path.relative_to(REPO)}:{found.line}: {found.text}"
            for module, path in product_files().items()
            for found in imports_of(module, path) if not allowed(module.split(".")[0], found.names[-1].split(".")[0])]


def test_the_kernel_imports_no_role_and_not_the_launch_layer():
    wrong = layer_violations(lambda importer, imported: importer != KERNEL or imported == KERNEL)
    assert not wrong, "the kernel (async_rl/) must import no role (rollout, replay, learner) and not launch:\n" + \
        "\n".join(wrong)


def test_each_role_imports_only_the_kernel_and_itself():
    wrong = layer_violations(lambda importer, imported: importer not in ROLES or imported in (KERNEL, importer))
    assert not wrong, "a role imports only async_rl/ and itself (never another role, never launch):\n" + \
        "\n".join(wrong)


def test_no_import_cycle_among_the_products_modules():
    """The graph of modules, with every import as an edge: one inside a function or under `if TYPE_CHECKING:` is
    still a dependency (a function-level import that dodges a circle at import time leaves the circle in the
    design). Each circle found is named by its modules and the imports that close it."""
    files = product_files()
    modules = set(files)
    edges: dict[str, dict[str, str]] = {module: {} for module in modules}
    for module, path in files.items():
        for found in imports_of(module, path):
            for target in sorted({resolve(name, modules) for name in found.names} - {None, module}):
                edges[module].setdefault(target, f"{path.relative_to(REPO)}:{found.line}: {found.text}")
    circles = [sorted(component) for component in _components(edges) if len(component) > 1]
    assert not circles, "import circles among the product's modules:\n" + "\n".join(
        f"{', '.join(circle)}:\n  " + "\n  ".join(edges[a][b] for a in circle for b in sorted(edges[a]) if b in circle)
        for circle in circles)


def _components(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of the graph (Tarjan): modules that reach one another by imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def test_every_product_file_says_its_job_and_architecture_md_names_it():
    """A file does one job, said in its docstring's first line; docs/architecture.md's table names every file."""
    table = (REPO / "docs" / "architecture.md").read_text()
    unsaid, unlisted = [], []
    for module, path in product_files().items():
        if path.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if not doc or not doc.strip():
            unsaid.append(str(path.relative_to(REPO)))
        inside = path.relative_to(REPO / module.split(".")[0]).as_posix()  # e.g. engines/thread.py
        if f"`{inside}`" not in table:
            unlisted.append(str(path.relative_to(REPO)))
    assert unsaid == [], f"files without a docstring saying their job: {unsaid}"
    assert unlisted == [], f"files docs/architecture.md's layout table does not name: {unlisted}"


def config_params(path: Path, config_types: set[str]) -> list[tuple[str, int, str]]:
    """(function, line, parameter) for each parameter of a function or method in the file annotated with one of
    `config_types` (anywhere in the annotation: `Config | None` counts)."""
    found = []
    for scope in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        for node in ast.iter_child_nodes(scope):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            name = f"{scope.name}.{node.name}" if isinstance(scope, ast.ClassDef) else node.name
            arguments = node.args
            for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg,
                        arguments.kwarg]:
                if arg is None or arg.annotation is None:
                    continue
                annotation = arg.annotation  # a quoted one ("Config") is parsed as the expression it quotes
                if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                    annotation = ast.parse(annotation.value, mode="eval").body
                names = {part.id if isinstance(part, ast.Name) else part.attr
                         for part in ast.walk(annotation) if isinstance(part, ast.Name | ast.Attribute)}
                if names & config_types:
                    found.append((name, node.lineno, arg.arg))
    return found


def test_below_the_replays_entry_no_component_takes_the_config():
    """The replay's entry (replay/server.py) reads the run's `Config`, and replay/settings.py's
    `ReplaySettings.from_config` builds each component's own settings from it; no other function or constructor in
    replay/ takes the `Config` or one of its sections (issue 55): a component gets only the values it uses."""
    import msgspec

    import async_rl.config

    config_types = {name for name, value in vars(async_rl.config).items()
                    if isinstance(value, type) and issubclass(value, msgspec.Struct)}
    assert {"Config", "AlgoConfig", "ReplayConfig"} <= config_types
    allowed = {("server.py", None), ("settings.py", "ReplaySettings.from_config")}
    wrong = [f"replay/{path.name}:{line}: {function}({param}: ...)"
             for path in sorted((REPO / "replay").glob("*.py"))
             for function, line, param in config_params(path, config_types)
             if (path.name, None) not in allowed and (path.name, function) not in allowed]
    assert not wrong, "below the replay's entry, a component takes its settings, not the config:\n" + "\n".join(wrong)


def test_below_the_learners_entries_no_component_takes_the_config():
    """The learner's entries (learner/trainer.py `run`, the role's; learner/sft.py `run_sft`, `async-rl sft`'s) read
    the run's `Config`, and learner/settings.py's `LearnerSettings.from_config` builds each component's own settings
    from it; no other function or constructor in learner/ takes the `Config` or one of its sections (issue 55)."""
    config_types = config_struct_names()
    assert {"AlgoConfig", "LearnerConfig", "LoraConfig"} <= config_types
    allowed = {("trainer.py", "run"), ("sft.py", "run_sft"), ("settings.py", "LearnerSettings.from_config")}
    found = [(path.name, function, line, param) for path in sorted((REPO / "learner").glob("*.py"))
             for function, line, param in config_params(path, config_types)]
    assert allowed <= {(name, function) for name, function, _, _ in found}, "the entries take the config"
    wrong = [f"learner/{name}:{line}: {function}({param}: ...)" for name, function, line, param in found
             if (name, function) not in allowed]
    assert not wrong, "below the learner's entries, a component takes its settings:\n" + "\n".join(wrong)


def config_struct_names() -> set[str]:
    """The names of async_rl/config.py's structs: the `Config` and its sections."""
    import msgspec

    import async_rl.config

    names = {name for name, value in vars(async_rl.config).items()
             if isinstance(value, type) and issubclass(value, msgspec.Struct)}
    assert {"Config", "RolloutConfig", "SGLangConfig", "ModelConfig"} <= names
    return names


def test_below_the_rollout_entries_no_component_takes_the_config():
    """The rollout side's entries read the run's `Config`: the worker role's `run` (rollout/worker.py, launch/roles.py
    calls it) and the commands' `evaluate` (`async-rl evaluate`, `train`'s final evaluation) and `write_demonstrations`
    (`async-rl demos`); rollout/settings.py's `RolloutSettings.from_config` builds each component's own settings from
    it. No other function or constructor in rollout/ (its subpackages included) takes the `Config` or one of its
    sections (issue 55): a component gets only the values it uses."""
    allowed = {("worker.py", "run"), ("evaluate.py", "evaluate"), ("demos.py", "write_demonstrations"),
               ("settings.py", "RolloutSettings.from_config")}
    wrong = [f"rollout/{inside}:{line}: {function}({param}: ...)"
             for path in sorted((REPO / "rollout").rglob("*.py"))
             for inside in [path.relative_to(REPO / "rollout").as_posix()]
             for function, line, param in config_params(path, config_struct_names())
             if (inside, function) not in allowed]
    assert not wrong, "below the rollout entries, a component takes its settings, not the config:\n" + "\n".join(wrong)


def test_the_kernel_takes_values_not_the_config():
    """The shared kernel (async_rl/, but for config.py and config_load.py, which define and load the config) takes
    the values it uses or a small settings struct of its own, never the `Config`: each role reads its config at its
    entry. The one section a kernel function takes is `ModelConfig`, where it uses the section as a whole: the tiny
    model is built from its sizes (async_rl/model.py)."""
    allowed = {("model.py", "build_tiny_model", "model"), ("model.py", "ensure_model_dir", "model")}
    wrong = [f"async_rl/{inside}:{line}: {function}({param}: ...)"
             for path in sorted((REPO / "async_rl").rglob("*.py"))
             for inside in [path.relative_to(REPO / "async_rl").as_posix()]
             if inside not in ("config.py", "config_load.py")
             for function, line, param in config_params(path, config_struct_names())
             if (inside, function, param) not in allowed]
    assert not wrong, "the kernel takes values or its own settings, not the config:\n" + "\n".join(wrong)
