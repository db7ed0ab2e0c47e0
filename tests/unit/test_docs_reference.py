"""The reference pages stay true to the code.

Three pages are generated at build time by scripts/docs_hooks.py (the command line, the config
classes, the errors): the tests here check the generators cover everything. Two are written by
hand, so they are checked against the code both ways:

- docs/reference/metrics.md against the keys the code writes to history.jsonl and to trajectories'
  and groups' ``metrics`` (:func:`code_metric_keys` says how they are found);
- docs/reference/settings.md against every ``JOURNEYMAN_*`` name the code reads.
"""

from __future__ import annotations

import ast
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import journeyman as jm
from tests.docs_snippets import docs_hooks

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
TABLE_KEY = re.compile(r"^\|\s*`(?P<key>[^`]+)`\s*\|", re.MULTILINE)


def documented(page: str) -> set[str]:
    """The names in the first column of the page's tables (written as code)."""
    return set(TABLE_KEY.findall((REFERENCE / page).read_text(encoding="utf-8")))


# -- metrics --------------------------------------------------------------------------------------------

PRODUCERS = (
    "backend/training/metrics.py",  # the step's data and loss numbers
    "backend/training/batch.py",  # the data/ counts
    "backend/training/trainer.py",  # time/, train/grad_norm, the train row
    "backend/training/sft.py",  # supervised runs: sft/ keys, the sft_batch rows
    "backend/local.py",  # time/sleep, time/wake (TrainResult only)
    "core/loop.py",  # the rollouts and evaluation rows
    "core/ruler.py",  # judging: trajectory and group metrics
    "integrations/capture.py",  # the tracers' trajectory metrics
    "integrations/openai_agents.py",
)
"""The modules that write metrics. A new one that writes keys belongs here."""

SLASH_KEY = re.compile(r"^[a-z]+/[a-z0-9_]+$")
METRIC_HOLDERS = {"metrics", "counts", "_sleep_times"}
"""Names of the dicts whose string subscripts are metric keys (``x.metrics["k"] = ...``)."""


def _summary_keys() -> set[str]:
    from journeyman.model import summarize

    group = jm.TrajectoryGroup([jm.Trajectory(reward=1.0)])
    return set(summarize([group]))


def _fstring_expansions() -> dict[str, set[str]]:
    """What each f-string key the code builds stands for, in this page's words. An f-string key
    not listed here fails the test: document it, then add it."""
    from journeyman.records import TOOL_CALL_FORMS
    from journeyman.ruler import RewardFrom

    summary = _summary_keys()
    return {
        "rollouts/{}": {f"rollouts/{k}" for k in summary} | {"rollouts/<metric>"},  # the loop's summary
        "{}/{}": {f"<split>/{k}" for k in summary} | {"<split>/<metric>"},  # an evaluation's summary
        "ruler_{}": {f"ruler_{v}" for v in typing.get_args(RewardFrom) if v != "score"},
        "tool_calls_{}": {f"tool_calls_{form}" for form in TOOL_CALL_FORMS},
    }


def _pattern(node: ast.JoinedStr) -> str:
    return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)


def _strings(node: ast.expr) -> Iterator[ast.expr]:
    """The string expressions a key position holds (both branches of ``a if c else b``)."""
    if isinstance(node, ast.IfExp):
        yield from _strings(node.body)
        yield from _strings(node.orelse)
    elif isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        yield node


def _holder(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _comprehension_values(node: ast.DictComp, name: str) -> list[str] | None:
    """The constant strings ``name`` runs over in ``{... for name in ("a", "b")}``, if so."""
    for generator in node.generators:
        if (
            isinstance(generator.target, ast.Name)
            and generator.target.id == name
            and isinstance(generator.iter, ast.Tuple | ast.List)
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in generator.iter.elts)
        ):
            return [typing.cast(ast.Constant, e).value for e in generator.iter.elts]
    return None


def _history_rows(tree: ast.Module) -> Iterator[ast.Dict]:
    """History rows: dicts given to ``*.append_history(...)``, or assigned to ``row`` with a ``split``."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "append_history"
        ):
            yield from (arg for arg in node.args if isinstance(arg, ast.Dict))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            named_row = any(isinstance(t, ast.Name) and t.id == "row" for t in node.targets)
            if named_row and any(isinstance(k, ast.Constant) and k.value == "split" for k in node.value.keys):
                yield node.value


def _keys_in(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The metric keys one module writes, and the patterns of the f-string keys it builds.

    A key is (1) a string of the form ``prefix/name`` in a dict's keys or a subscript; (2) any
    string key of a history row (:func:`_history_rows`: ``step``, ``elapsed_s``, ``recovered``);
    (3) a string subscript stored into a dict named like :data:`METRIC_HOLDERS`, or a key of a
    dict given to ``*.metrics.update`` or assigned to ``*.metrics``. An f-string in a dict
    comprehension over a tuple of strings is expanded; one read (``metrics[f"a/{k}"]``) is not a key."""
    keys: set[str] = set()
    patterns: set[str] = set()
    rows = {id(node) for node in _history_rows(tree)}

    def take(node: ast.expr, always: bool, comprehension: ast.DictComp | None = None) -> None:
        for string in _strings(node):
            if isinstance(string, ast.Constant):
                if always or SLASH_KEY.match(string.value):
                    keys.add(string.value)
                continue
            assert isinstance(string, ast.JoinedStr)
            names = [
                v.value.id
                for v in string.values
                if isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name)
            ]
            values = (
                _comprehension_values(comprehension, names[0]) if comprehension and len(names) == 1 else None
            )
            pattern = _pattern(string)
            if values is not None:
                keys.update(pattern.replace("{}", value) for value in values)
            elif always or "/" in pattern:
                patterns.add(pattern)

    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key in node.keys:
                if key is not None:
                    take(key, id(node) in rows)
        elif isinstance(node, ast.DictComp):
            take(node.key, False, node)
        elif isinstance(node, ast.Subscript):
            stored = isinstance(node.ctx, ast.Store) and _holder(node.value) in METRIC_HOLDERS
            if stored or not isinstance(node.slice, ast.JoinedStr):
                take(node.slice, stored)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and _holder(node.func.value) == "metrics"
        ):
            for arg in node.args:
                for key in arg.keys if isinstance(arg, ast.Dict) else []:
                    if key is not None:
                        take(key, True)
        if isinstance(node, ast.Assign) and any(_holder(t) == "metrics" for t in node.targets):
            for key in node.value.keys if isinstance(node.value, ast.Dict) else []:
                if key is not None:
                    take(key, True)
            for comp in (n for n in ast.walk(node.value) if isinstance(n, ast.DictComp)):
                take(comp.key, True, comp)
    return keys, patterns


def code_metric_keys() -> tuple[set[str], set[str]]:
    """Every metric key the code writes, in metrics.md's words, and the f-string keys no expansion
    covers. Read from :data:`PRODUCERS` (:func:`_keys_in` says how), plus what two functions
    return when run: the loop's summary of a group (``rollouts/...``, ``<split>/...``) and the
    capture's counts of an empty run (every count is always present)."""
    from journeyman.integrations.capture import build_trajectory

    expansions = _fstring_expansions()
    keys: set[str] = set()
    unknown: set[str] = set()
    for path in PRODUCERS:
        found, patterns = _keys_in(ast.parse((ROOT / path).read_text(encoding="utf-8"), path))
        keys |= found
        for pattern in patterns:
            if pattern in expansions:
                keys |= expansions[pattern]
            else:
                unknown.add(f"{path}: f-string key {pattern!r}")
    keys |= set(build_trajectory([], [], trajectory=jm.Trajectory()).metrics)
    keys |= {f"rollouts/{k}" for k in _summary_keys()} | {f"<split>/{k}" for k in _summary_keys()}
    return keys, unknown


def test_the_metrics_page_names_every_key_the_code_writes_and_no_other() -> None:
    keys, unknown = code_metric_keys()
    assert not unknown, f"document these in docs/reference/metrics.md, then expand them here: {unknown}"
    page = documented("metrics.md")
    missing, stale = sorted(keys - page), sorted(page - keys)
    assert not missing, f"docs/reference/metrics.md does not describe {missing}"
    assert not stale, f"docs/reference/metrics.md describes keys no code writes: {stale}"


def test_the_metric_key_finder_sees_each_kind_of_key() -> None:
    source = """
metrics["data/a"] = 1
counts["data/b"] += 1
row = {"step": 0, "split": "x", "elapsed_s": 1.0, **{f"rollouts/{k}": v for k, v in stats.items()}}
store.append_history({"step": 1, "split": "train", "recovered": 1})
labels = {"split": "train", "step": 0, "scenario_index": 0}
row = {"action": "promote", "step": 2}
judged = {f"rollouts/judge_{key}": 0 for key in ("seconds", "failed")}
trajectory.metrics["ruler_score"] = 1
trajectory.metrics[f"ruler_{how}"] = 1
trajectory.metadata["not_a_metric"] = 1
group["lr"] = 0.1
self.metrics = {"llm_calls": 0}
scored.metrics.update({"judge/failed": 0, "judge_note": 1})
self.metrics["a" if ok else "b"] += 1
value = metrics[f"judge/{key}"] + metrics["data/c"]
"""
    keys, patterns = _keys_in(ast.parse(source))
    assert keys == {
        "data/a", "data/b", "step", "split", "elapsed_s", "recovered", "rollouts/judge_seconds", "rollouts/judge_failed",
        "ruler_score", "llm_calls", "judge/failed", "judge_note", "a", "b", "data/c",
    }  # fmt: skip
    assert patterns == {"rollouts/{}", "ruler_{}"}


# -- environment variables ------------------------------------------------------------------------------

ENV_NAME = re.compile(r"\bJOURNEYMAN_[A-Z0-9_]*[A-Z0-9]\b")
SCANNED = ("core", "integrations", "backend", "scripts", "tests", "bench", "examples", "deploy")
SCANNED_FILES = ("Makefile", "pyproject.toml")
SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".toml", ".html", ".jinja", ".cfg", ".ini"}


def code_env_names() -> dict[str, str]:
    """Every ``JOURNEYMAN_*`` name in the code, scripts, tests and recipes, to a file naming it."""
    files = [ROOT / name for name in SCANNED_FILES]
    for folder in SCANNED:
        files += [
            p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES and "__pycache__" not in p.parts
        ]
    names: dict[str, str] = {}
    for path in files:
        for name in ENV_NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
            names.setdefault(name, str(path.relative_to(ROOT)))
    return names


def test_the_settings_page_names_every_environment_variable_and_no_other() -> None:
    names = code_env_names()
    page = documented("settings.md")
    missing = {name: where for name, where in names.items() if name not in page}
    assert not missing, f"docs/reference/settings.md does not describe {missing}"
    stale = sorted(page - set(names))
    assert not stale, f"docs/reference/settings.md describes variables no code reads: {stale}"
    assert "JOURNEYMAN_MAX_STEPS" in page


# -- the generated pages --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hooks() -> types.ModuleType:
    """scripts/docs_hooks.py, loaded as mkdocs loads it."""
    return docs_hooks()


def _commands() -> Iterator[tuple[str, Any]]:
    import typer.main

    from journeyman.backend.app.cli import app

    def walk(command: Any, path: str) -> Iterator[tuple[str, Any]]:
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            if not sub.hidden:
                yield from walk(sub, f"{path} {name}")

    yield from walk(typer.main.get_command(app), "journeyman")


def test_the_cli_page_has_every_command_and_option(hooks: types.ModuleType) -> None:
    markdown = hooks.cli_markdown()
    commands = list(_commands())
    assert len(commands) > 10
    for path, command in commands[1:]:
        assert re.search(rf"^#+ {re.escape(path)}$", markdown, re.MULTILINE), f"no section for {path}"
        section = markdown.split(f" {path}\n", 1)[1].split("\n#", 1)[0]
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            for option in [*param.opts, *param.secondary_opts]:
                shown = param.name.upper() if type(param).__name__.endswith("Argument") else option
                assert f"`{shown}" in section or f" {shown}`" in section, f"{path}: {shown} is missing"


def test_the_config_page_has_every_field_with_its_default(hooks: types.ModuleType) -> None:
    markdown = hooks.config_markdown()
    for cls in (jm.TrainConfig, jm.LoRAConfig):
        for name, field in cls.model_fields.items():
            row = re.search(rf"^\| `{name}` \|.*$", markdown, re.MULTILINE)
            assert row is not None, f"{cls.__name__}.{name} is missing"
            if field.default_factory is None:
                default = field.get_default()
                shown = f'"{default}"' if isinstance(default, str) else repr(default)
                assert f"`{shown}`" in row.group(0), (
                    f"{cls.__name__}.{name}: default {shown} not in {row.group(0)}"
                )
    for name in ("split", "scenarios", "samples", "judge", "judge_weight", "calibrate_anyway"):
        assert f"| `{name}` |" in markdown
    assert "| `dapo` | `ppo` | `token_mean` | 0.2 | 0.28 |" in markdown  # the loss table


def test_the_errors_page_has_every_error_under_its_parent(hooks: types.ModuleType) -> None:
    from journeyman import errors

    markdown = hooks.errors_markdown()
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert f"\n## {name}\n" in markdown
        if cls is not errors.JourneymanError:
            parent = next(b for b in cls.__bases__ if issubclass(b, errors.JourneymanError))
            assert (
                f"## {name}\n\n`from journeyman.errors import {name}` · subclass of [`{parent.__name__}`]"
                in markdown
            )


@pytest.mark.parametrize("page", sorted(REFERENCE.glob("*.md")), ids=lambda p: p.name)
def test_every_marker_is_replaced(hooks: types.ModuleType, page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert "<!-- generated:" not in hooks.generate(text, where=page.name)


def test_each_generated_page_has_its_marker() -> None:
    for page, name in (("cli.md", "cli"), ("config.md", "config"), ("errors.md", "errors")):
        assert f"\n<!-- generated: {name} -->\n" in (REFERENCE / page).read_text(encoding="utf-8")


def test_an_unknown_marker_fails_the_build(hooks: types.ModuleType) -> None:
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="unknown marker"):
        hooks.generate("# Page\n\n<!-- generated: nothing -->\n")


def test_the_source_tree_is_the_import_package(hooks: types.ModuleType, tmp_path: Path) -> None:
    tree = hooks.lay_out_source_tree(ROOT, tmp_path / "src")
    package = tree / "journeyman"
    assert (package / "__init__.py").resolve() == ROOT / "core" / "__init__.py"
    assert (package / "loop.py").resolve() == ROOT / "core" / "loop.py"
    assert (package / "backend" / "local.py").resolve() == ROOT / "backend" / "local.py"
    assert (package / "integrations" / "langgraph.py").resolve() == ROOT / "integrations" / "langgraph.py"
    (package / "gone.py").symlink_to("../../nowhere.py")  # a module since removed from core/
    before = sorted(p.name for p in package.iterdir() if p.name != "gone.py")
    hooks.lay_out_source_tree(ROOT, tmp_path / "src")  # again: the same tree, the stale link gone
    assert sorted(p.name for p in package.iterdir()) == before


def test_restructured_text_in_docstrings_becomes_markdown(hooks: types.ModuleType) -> None:
    text = "Use :class:`~journeyman.loop.TrainingLoop` or :func:`journeyman.rollout_info`. For example::\n\n    x = 1\n"
    assert hooks.rst_to_markdown(text) == (
        "Use `TrainingLoop` or `journeyman.rollout_info`. For example:\n\n    x = 1\n"
    )
    assert hooks.rst_to_markdown("::\n\n    x = 1") == "\n\n    x = 1"


def test_a_table_cell_escapes_pipes_and_tags_outside_code_only(hooks: types.ModuleType) -> None:
    assert hooks._cell("a | `x | y`\n and ``<b> | c`` <i> x < 3") == (
        "a \\| `x | y` and ``<b> | c`` &lt;i> x < 3"
    )
