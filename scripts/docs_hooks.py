"""mkdocs hooks: reference pages generated from the code at build time, so they cannot go stale.

- ``on_config`` lays out ``build/docs-src/journeyman``, the import package as one tree of symlinks
  (core/ -> journeyman, integrations/ -> journeyman.integrations, backend/ -> journeyman.backend,
  as pyproject's ``package-dir`` maps them), where mkdocstrings (griffe) reads the API pages from.
  The tree is made in place, link by link, so two builds running at once do not break each other.
- ``on_page_markdown`` replaces a marker ``<!-- generated: NAME -->`` with the markdown that
  :data:`GENERATORS` makes from the code: ``cli`` (every ``journeyman`` command and option, from the
  Typer app), ``config`` (the fields of TrainConfig, LoRAConfig, SFTConfig, EvalSet, JudgeReward),
  ``errors`` (the error tree of ``journeyman.errors``) and ``gpu-fit`` (what fits on which GPU,
  from the memory plan). An unknown marker fails the build.
- :class:`RstMarkup` is a griffe extension (mkdocs.yml names it) that turns the reStructuredText
  left in docstrings (``:class:`X```, a paragraph ending ``::``) into markdown.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import griffe
from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_PARTS = {"integrations": "integrations", "backend": "backend"}
"""Subpackages of ``journeyman`` kept in folders of their own (linked whole); core/ is linked file by file."""
MARKER = re.compile(r"^<!-- generated: (?P<name>[a-z_-]+) -->$", re.MULTILINE)
CONFIG_CLASSES = (
    "journeyman.config:TrainConfig",
    "journeyman.config:LoRAConfig",
    "journeyman.config:SFTConfig",
    "journeyman.loop:EvalSet",
    "journeyman.loop:JudgeReward",
)


# -- the source tree ----------------------------------------------------------------------------------


def _link(link: Path, target: str) -> None:
    """Make ``link`` a symlink to ``target`` unless it already is one (atomically: a build that
    reads the tree meanwhile sees the old link or the new one)."""
    if link.is_symlink() and os.readlink(link) == target:
        return
    temporary = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    temporary.symlink_to(target)
    os.replace(temporary, link)


def lay_out_source_tree(root: Path = ROOT, tree: Path | None = None) -> Path:
    """Lay out ``tree/journeyman`` as the import package, made of symlinks into ``root``; entries
    that no longer exist in the source are removed. ``tree`` defaults to ``root/build/docs-src``,
    where mkdocs.yml points mkdocstrings. Returns ``tree``."""
    tree = tree if tree is not None else root / "build" / "docs-src"
    package = tree / "journeyman"
    package.mkdir(parents=True, exist_ok=True)
    up = os.path.relpath(root, package)
    wanted = {
        entry.name: f"{up}/core/{entry.name}"
        for entry in (root / "core").iterdir()
        if entry.name != "__pycache__" and not entry.name.startswith(".")
    }
    wanted.update({name: f"{up}/{folder}" for name, folder in PACKAGE_PARTS.items()})
    for name, target in sorted(wanted.items()):
        _link(package / name, target)
    for entry in package.iterdir():
        if entry.name not in wanted and entry.is_symlink():
            entry.unlink()
    return tree


def _importable(tree: Path) -> None:
    """Let the generators ``import journeyman`` in a clean clone too (not installed): from the tree."""
    if importlib.util.find_spec("journeyman") is None:
        sys.path.insert(0, str(tree))


# -- mkdocs hooks ---------------------------------------------------------------------------------------


# Before mkdocstrings' on_config: its handler keeps only the `paths` that exist when it starts.
@event_priority(100)
def on_config(config: Any) -> Any:
    tree = lay_out_source_tree(Path(config.config_file_path).resolve().parent)
    _importable(tree)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return generate(markdown, where=str(page.file.src_uri))


def generate(markdown: str, where: str = "a page") -> str:
    """``markdown`` with each ``<!-- generated: NAME -->`` line replaced by what ``NAME`` makes."""

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in GENERATORS:
            from mkdocs.exceptions import PluginError

            raise PluginError(
                f"{where}: unknown marker <!-- generated: {name} --> (known: {sorted(GENERATORS)})"
            )
        return GENERATORS[name]().rstrip("\n")

    return MARKER.sub(replace, markdown)


# -- markdown helpers -----------------------------------------------------------------------------------


CODE_SPAN = re.compile(r"(`+).+?(?<!`)\1(?!`)")


def _cell(text: str) -> str:
    """``text`` as one markdown table cell: on one line; outside code spans, pipes escaped and a
    ``<`` that would open an HTML tag written as an entity (Python-Markdown's tables keep a pipe
    inside a code span, and an escape there would show)."""

    def plain(part: str) -> str:
        return re.sub(r"<(?=[A-Za-z/!])", "&lt;", part).replace("|", "\\|")

    text = " ".join(text.split())
    pieces, start = [], 0
    for span in CODE_SPAN.finditer(text):
        pieces += [plain(text[start : span.start()]), span.group(0)]
        start = span.end()
    return "".join([*pieces, plain(text[start:])])


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _paragraphs(doc: str | None) -> list[str]:
    """A docstring's paragraphs, each on one line, its reStructuredText roles made markdown."""
    if not doc:
        return []
    text = rst_to_markdown(inspect.cleandoc(doc))
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def _first_paragraph(doc: str | None) -> str:
    paragraphs = _paragraphs(doc)
    return paragraphs[0] if paragraphs else ""


ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|obj|exc|const):`~?(?P<target>[^`]+)`")


def rst_to_markdown(text: str) -> str:
    """The reStructuredText docstrings here use, as markdown: roles become code spans, a paragraph
    ending ``::`` (a literal block follows, indented) ends ``:``, a lone ``::`` goes."""

    def role(match: re.Match[str]) -> str:
        target = match["target"]
        shown = target.rsplit(".", 1)[-1] if match.group(0).split("`")[1].startswith("~") else target
        return f"`{shown}`"

    text = ROLE.sub(role, text)
    text = re.sub(r"(?m)^[ \t]*::[ \t]*$", "", text)
    return re.sub(r"(?m)(\S)::$", r"\1:", text)


class RstMarkup(griffe.Extension):
    """Griffe extension: docstrings' reStructuredText roles and ``::`` as markdown (rst_to_markdown)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)


# -- types ----------------------------------------------------------------------------------------------


def _literal_values(annotation: Any) -> tuple[Any, ...] | None:
    return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None


def format_type(annotation: Any) -> str:
    """A runtime annotation in the words a reader of a table wants: ``"a" | "b"`` for a Literal,
    ``int | None``, ``tuple[str, ...]``."""
    if annotation is type(None):
        return "None"
    if (values := _literal_values(annotation)) is not None:
        return " | ".join(f'"{v}"' if isinstance(v, str) else repr(v) for v in values)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(format_type(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else format_type(a) for a in typing.get_args(annotation))
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{args}]" if args else name
    if isinstance(annotation, type | typing.TypeVar):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _source_names(module: types.ModuleType) -> dict[str, str]:
    """Names a module imports (``if TYPE_CHECKING:`` too), to the module each comes from."""
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                found[alias.asname or alias.name] = node.module
    return found


def _resolve(text: str, module: types.ModuleType) -> Any:
    """An annotation written as ``text`` in ``module`` (``from __future__ import annotations``),
    evaluated there; names imported only for type checkers are imported here. ``text`` itself
    when it cannot be evaluated."""
    namespace = dict(vars(module))
    imports = _source_names(module)
    for name in re.findall(r"[A-Za-z_]\w*", text):
        if name not in namespace and name in imports:
            with contextlib.suppress(ImportError, AttributeError):
                namespace[name] = getattr(importlib.import_module(imports[name]), name)
    try:
        return eval(text, namespace)
    except Exception:
        return text


# -- config ---------------------------------------------------------------------------------------------


def field_docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal right below its annotated assignment."""
    body = ast.parse(inspect.cleandoc("\n" + inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for statement, following in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = following.value.value
    return docs


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    type: str
    default: str
    doc: str


_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _default(value: Any) -> str:
    if value is dataclasses.MISSING or repr(value) == "PydanticUndefined":
        return "required"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def config_fields(cls: type) -> list[Field]:
    """The fields of a pydantic model or a dataclass: name, type, default, docstring."""
    docs = field_docstrings(cls)
    module = sys.modules[cls.__module__]
    fields: list[Field] = []
    model_fields: dict[str, Any] | None = getattr(cls, "model_fields", None)
    if model_fields is not None:
        for name, info in model_fields.items():
            bounds = [
                f"{symbol} {getattr(rule, key)}"
                for rule in info.metadata
                for key, symbol in _BOUNDS.items()
                if getattr(rule, key, None) is not None
            ]
            kind = f"`{format_type(info.annotation)}`" + (f" ({', '.join(bounds)})" if bounds else "")
            default = (
                f"`{info.default_factory.__name__}()`"
                if info.default_factory is not None
                else _default(info.get_default())
            )
            fields.append(Field(name, kind, default, docs.get(name, "")))
        return fields
    for item in dataclasses.fields(cls):
        annotation = _resolve(item.type, module) if isinstance(item.type, str) else item.type
        factory = item.default_factory
        default = (
            f"`{getattr(factory, '__name__', factory)}()`"
            if factory is not dataclasses.MISSING
            else _default(item.default)
        )
        fields.append(Field(item.name, f"`{format_type(annotation)}`", default, docs.get(item.name, "")))
    return fields


def _class_named(spec: str) -> type:
    module, _, name = spec.partition(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def config_markdown() -> str:
    """Every field of the user-facing settings classes, with its type, default and docstring."""
    parts: list[str] = []
    for spec in CONFIG_CLASSES:
        cls = _class_named(spec)
        public = f"jm.{cls.__name__}"
        parts.append(f"## {cls.__name__}\n")
        parts.append(f"`{public}` (defined in `{cls.__module__}`).\n")
        parts.extend(f"{p}\n" for p in _paragraphs(cls.__doc__))
        rows = [
            (f"`{f.name}`", _cell(f.type), _cell(f.default), _cell(" ".join(_paragraphs(f.doc))))
            for f in config_fields(cls)
        ]
        parts.append(_table(("Field", "Type", "Default", "Description"), rows))
        if cls.__name__ == "TrainConfig":
            parts.append(_losses_markdown())
    return "\n".join(parts)


def _losses_markdown() -> str:
    from journeyman.config import LOSSES

    rows = [
        (f"`{name}`", f"`{v.objective}`", f"`{v.aggregation}`", f"{v.epsilon:g}", f"{v.epsilon_high:g}")
        for name, v in LOSSES.items()
    ]
    return (
        "### Losses\n\nWhat each `loss` runs, and the clip range it takes when `epsilon` and "
        "`epsilon_high` are left unset.\n\n"
        + _table(("`loss`", "objective", "aggregation", "epsilon", "epsilon_high"), rows)
    )


# -- errors ---------------------------------------------------------------------------------------------


def error_tree() -> list[tuple[int, type[BaseException]]]:
    """The classes of ``journeyman.errors`` under ``JourneymanError``, depth first, with their depth."""
    from journeyman import errors

    root = errors.JourneymanError
    ours = {
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, root) and obj.__module__ == errors.__name__
    }

    def walk(cls: type[BaseException], depth: int) -> Iterator[tuple[int, type[BaseException]]]:
        yield depth, cls
        children = [c for c in ours if c is not root and _parent(c, root) is cls]
        for child in sorted(children, key=lambda c: c.__name__):
            yield from walk(child, depth + 1)

    return list(walk(root, 0))


def _parent(cls: type, root: type) -> type:
    """The first base of ``cls`` under ``root`` (its place in the tree)."""
    return next(base for base in cls.__bases__ if issubclass(base, root))


def draw_tree(tree: Sequence[tuple[int, type]]) -> str:
    """A depth-first list of (depth, class) drawn as a tree, the way ``journeyman.errors`` draws it."""
    lines: list[str] = []
    for i, (depth, cls) in enumerate(tree):
        if depth == 0:
            lines.append(cls.__name__)
            continue
        later = [d for d, _ in tree[i + 1 :]]

        def continues(level: int, later: list[int] = later) -> bool:
            """Whether another node at ``level`` follows before the tree climbs above it."""
            for d in later:
                if d < level:
                    return False
                if d == level:
                    return True
            return False

        rails = "".join("│   " if continues(level) else "    " for level in range(1, depth))
        lines.append(f"{rails}{'├── ' if continues(depth) else '└── '}{cls.__name__}")
    return "\n".join(lines)


def errors_markdown() -> str:
    """The error tree, then one section per error: its parent, the Python errors it also is, and
    the first paragraph of its docstring."""
    from journeyman.errors import JourneymanError

    tree = error_tree()
    parts = [f"```text\n{draw_tree(tree)}\n```\n"]
    for _, cls in tree:
        parts.append(f"## {cls.__name__}\n")
        bases = [b for b in cls.__bases__ if b is not Exception]
        ours = [b.__name__ for b in bases if issubclass(b, JourneymanError)]
        python = [b.__name__ for b in bases if not issubclass(b, JourneymanError)]
        facts = [f"`from journeyman.errors import {cls.__name__}`"]
        if ours:
            facts.append(f"subclass of [`{ours[0]}`](#{ours[0].lower()})")
        if python:
            facts.append("also a Python " + ", ".join(f"`{name}`" for name in python))
        parts.append(" · ".join(facts) + "\n")
        if paragraph := _first_paragraph(cls.__doc__):
            parts.append(paragraph + "\n")
    return "\n".join(parts)


# -- the command line -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Command:
    path: str
    """``journeyman model prepare``"""
    help: str
    usage: str
    params: list[Any]
    is_group: bool
    depth: int


def cli_commands() -> list[Command]:
    """Every command of the ``journeyman`` Typer app, groups first then their commands, depth first,
    in the order ``--help`` lists them; hidden ones left out."""
    import typer.main

    from journeyman.backend.app.cli import app

    root = typer.main.get_command(app)
    found: list[Command] = []

    def walk(command: Any, name: str, parent: Any, depth: int) -> None:
        context = command.context_class(command, info_name=name, parent=parent)
        subcommands = getattr(command, "commands", None)
        path = context.command_path
        usage = command.get_usage(context).removeprefix("Usage: ").strip()
        usage = re.sub(r"\{(\w+)\}", lambda m: m[1].upper(), usage)  # Typer writes arguments as {name}
        found.append(Command(path, command.help or "", usage, command.params, subcommands is not None, depth))
        for sub in command.list_commands(context) if subcommands is not None else []:
            child = command.get_command(context, sub)
            if child is not None and not child.hidden:
                walk(child, sub, context, depth + 1)

    walk(root, "journeyman", None, 0)
    return found


def _param_type(param: Any) -> str:
    annotation = param.type_descriptor.annotation
    if getattr(param, "is_flag", False) or annotation is bool:
        return "flag"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is list:
        (annotation,) = typing.get_args(annotation)
    words = {str: "text", int: "integer", float: "number", Path: "path"}
    kind = words.get(annotation) or format_type(annotation)
    return f"{kind}, repeatable" if param.multiple else kind


def _param_default(param: Any) -> str:
    if param.required:
        return "required"
    default = param.default
    if default is None or default == () or default == []:
        return ""
    if isinstance(default, bool):
        if param.secondary_opts:  # --x / --no-x: the default is one of them
            return f"`{param.opts[0] if default else param.secondary_opts[0]}`"
        return "on" if default else "off"
    return f"`{default}`"


def _param_name(param: Any) -> str:
    if type(param).__name__.endswith("Argument"):
        return f"`{param.name.upper()}`"
    names = " / ".join([*param.opts, *param.secondary_opts])
    return f"`{names}`"


def cli_markdown() -> str:
    """Every ``journeyman`` command: what it does, its usage line, a table of its arguments and options."""
    parts: list[str] = []
    commands = cli_commands()
    for command in commands[1:]:
        level = "#" * (command.depth + 1)
        parts.append(f"{level} {command.path}\n")
        parts.extend(f"{p}\n" for p in _paragraphs(command.help))
        if command.is_group:
            subs = [
                c for c in commands if c.path.startswith(command.path + " ") and c.depth == command.depth + 1
            ]
            parts.append("Commands: " + ", ".join(f"[`{c.path}`](#{_slug(c.path)})" for c in subs) + ".\n")
            continue
        parts.append(f"```text\n{command.usage}\n```\n")
        rows = []
        for param in command.params:
            if getattr(param, "hidden", False) or param.name == "help":
                continue
            description = " ".join(_paragraphs(getattr(param, "help", None) or ""))
            if param.envvar:
                envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
                description += " Environment: " + ", ".join(f"`{e}`" for e in envvars) + "."
            rows.append(
                (
                    _param_name(param),
                    _cell(_param_type(param)),
                    _cell(_param_default(param)),
                    _cell(description),
                )
            )
        if rows:
            parts.append(_table(("Argument or option", "Type", "Default", "Description"), rows))
    return "\n".join(parts)


def _slug(heading: str) -> str:
    """The anchor mkdocs' toc gives a heading of plain words."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def gpu_fit_markdown() -> str:
    """What fits on which GPU with a judge beside the policy: the memory plan's own table."""
    from journeyman.backend.serving.gpu_memory import fit_table

    return fit_table()


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_markdown,
    "config": config_markdown,
    "errors": errors_markdown,
    "gpu-fit": gpu_fit_markdown,
}
"""What each ``<!-- generated: NAME -->`` marker is replaced with."""
