"""README.md and docs/*.md point at things that exist: every relative link resolves (file present, #anchor a
heading of that file, GitHub's slug rule), every command they name exists (``python -m X``: importable;
``python file.py``: present; ``dvc ...``: a subcommand of DVC's own parser, a copy-pasteable fenced command
parses with all its options, ``dvc repro <stage>`` names a stage of dvc.yaml; ``prefect ...``: a command listed
by ``prefect [group] --help``), every test they name exists (``tests/<dir>/<file>.py[::<name>]``,
``<level>/test_<file>[::<name>]``: the file, and the name defined in it), and the reference tables cover every
params key and every convert rule."""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import logging
import re
import shlex
import sys
import typing
from pathlib import Path

import pytest
import yaml

from support.procs import run

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PLACEHOLDER = "PLACEHOLDER"
FENCE = re.compile(r"^\s*```")
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}


def _split_fenced(text: str) -> tuple[str, list[str]]:
    """(the prose with fenced blocks blanked out, the shell lines of the fenced blocks with ``\\`` continuations
    joined)."""
    prose, shell, lang = [], [], None
    pending = ""
    for line in text.splitlines():
        if FENCE.match(line):
            lang = line.strip()[3:].strip().lower() if lang is None else None
            prose.append("")
            continue
        if lang is None:
            prose.append(line)
            continue
        prose.append("")
        if lang in SHELL_LANGS:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
            else:
                shell.append(pending + line)
                pending = ""
    return "\n".join(prose), shell


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than ``-`` and ``_`` removed, spaces -> ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """Anchors of the headings of the markdown file ``path``."""
    return anchors_of(_split_fenced(path.read_text())[0])


def anchors_of(prose: str) -> frozenset[str]:
    """Anchors of the headings in markdown ``prose`` (fenced blocks removed; repeated headings get ``-1``, ``-2``,
    ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def link_problems(path: Path, prose: str) -> list[str]:
    """Relative links of ``prose`` (a page at ``path``) whose file or #anchor does not exist."""
    text = re.sub(r"`[^`]*`", "code", prose)              # a link inside a code span is not a link
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not file:
            if anchor not in anchors_of(prose):
                problems.append(f"link {target}: no heading with anchor #{anchor} in this page")
        elif not dest.exists():
            problems.append(f"link {target}: {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest} "
                            "does not exist")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"link {target}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def commands(prose: str, shell: list[str]) -> list[tuple[list[str], bool]]:
    """Commands named in a page: ``(argv, full)`` for each segment (split at ``&&``, ``||``, ``;``, ``|``) of a
    fenced shell line (full: meant to be run as written) and of an inline code span that starts with
    ``python``, ``dvc`` or ``prefect`` (a mention: only its (sub)command must exist). ``<...>`` placeholders
    become `PLACEHOLDER`; leading ``VAR=value`` assignments are dropped."""
    spans = [(" ".join(s.split()), False) for s in re.findall(r"`([^`]+)`", prose)]
    spans = [(s, f) for s, f in spans if re.match(r"(python3? |dvc |prefect )", s)]
    out = []
    for line, full in [(ln, True) for ln in shell] + spans:
        line = re.sub(r"<[^<>]*>", PLACEHOLDER, line)
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split, lex.commenters = True, "#"
        try:
            tokens = list(lex)
        except ValueError as e:
            out.append(([f"unparsable shell line {line!r}: {e}"], full))
            continue
        argv: list[str] = []
        for tok in tokens + [";"]:
            if tok and set(tok) <= set(";&|"):
                while argv and re.match(r"^[A-Za-z_]\w*=", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append((argv, full))
                argv = []
            else:
                argv.append(tok)
    return out


@functools.cache
def dvc_stages() -> frozenset[str]:
    return frozenset(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])


def _dvc_parser() -> argparse.ArgumentParser:
    from dvc.cli.parser import get_main_parser

    return get_main_parser()


def dvc_problem(args: list[str], full: bool) -> str | None:
    """What is wrong with ``dvc <args>``: an unknown (sub)command, options DVC's parser refuses (``full``), or a
    ``dvc repro`` target that is not a stage of dvc.yaml."""
    parser, path = _dvc_parser(), ["dvc"]
    rest = list(args)
    while rest:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            break
        tok = rest.pop(0)
        if tok.startswith("-"):
            continue
        if tok not in subs[0].choices:
            return f"{' '.join(path)} has no subcommand {tok!r}"
        parser = subs[0].choices[tok]
        path.append(tok)
    if len(path) == 1:
        return "dvc without a subcommand"
    if full:
        from dvc.cli import DvcParserError

        # DVC's parser logs its refusal on the "dvc" logger; a test that ran DVC in this process before may have left
        # a handler there bound to that test's (now closed) captured stream: log into `err` for this call only.
        dvc_log = logging.getLogger("dvc")
        saved = dvc_log.handlers[:], dvc_log.propagate
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
                dvc_log.handlers, dvc_log.propagate = [logging.StreamHandler(err)], False
                _dvc_parser().parse_args(args)
        except (DvcParserError, SystemExit):
            return f"dvc {' '.join(args)}: DVC refuses it: {err.getvalue().strip().splitlines()[-1:]}"
        finally:
            dvc_log.handlers, dvc_log.propagate = saved
    if path[1:] == ["repro"]:
        bad = [t for t in rest if not t.startswith("-") and t != PLACEHOLDER and t not in dvc_stages()]
        if bad:
            return f"dvc repro {bad[0]}: no such stage in dvc.yaml ({sorted(dvc_stages())})"
    return None


@functools.cache
def prefect_commands(group: str | None) -> frozenset[str]:
    """Command names (and aliases) that ``prefect [group] --help`` lists."""
    argv = [sys.executable, "-m", "prefect", *([group] if group else []), "--help"]
    out = run(argv, REPO, env={"COLUMNS": "200", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                               "DO_NOT_TRACK": "1"}, timeout=120).stdout
    names = set()
    for m in re.finditer(r"^│ ([a-z][a-z0-9-]*)(?: \(([a-z0-9, -]+)\))?\s", out, re.M):
        names.add(m.group(1))
        names.update(a.strip() for a in (m.group(2) or "").split(","))
    assert names or group, f"no commands in `prefect --help`:\n{out[-2000:]}"
    return frozenset(names - {""})


def command_problem(argv: list[str], full: bool) -> str | None:
    """What is wrong with a command named in a page (see the module docstring), or None."""
    head = argv[0]
    if head.startswith("unparsable shell line"):
        return head
    if head in ("python", "python3") and len(argv) > 1:
        if argv[1] == "-m" and len(argv) > 2:
            module = argv[2]
            if PLACEHOLDER in module:
                return None
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            return None if found else f"python -m {module}: no such module"
        if argv[1].endswith(".py") and not (REPO / argv[1]).is_file():
            return f"python {argv[1]}: no such file"
        return None
    if head == "dvc":
        return dvc_problem(argv[1:], full)
    if head == "prefect":
        words = [a for a in argv[1:] if not a.startswith("-")][:2]
        if not words or words[0] not in prefect_commands(None):
            return f"prefect {' '.join(words)}: no such command"
        if len(words) > 1 and words[1] != PLACEHOLDER:
            group = prefect_commands(words[0])              # empty: a command without subcommands
            if group and words[1] not in group:
                return f"prefect {words[0]} {words[1]}: no such command"
        return None
    return None


# A test file named in a page: ``tests/<dir>/<file>.py`` with an optional ``::<name>``, or, in an inline code span,
# ``<level>/test_<file>`` with an optional ``::<name>`` (docs/testing.md's index of which tests prove what).
TEST_PATH = re.compile(r"\btests/((?:[\w-]+/)*[\w-]+\.py)(?:::(\w+))?")
TEST_SPAN = re.compile(r"`((?:unit|stages|system)/test_\w+)(?:::(\w+))?`")


def named_test_problems(prose: str) -> list[str]:
    """Test files a page names that do not exist, and names after ``::`` that their file does not define (a
    ``def``, ``class`` or module-level assignment)."""
    found = []
    refs = [(f"tests/{m[1]}", m[2]) for m in TEST_PATH.finditer(prose)]
    refs += [(f"tests/{m[1]}.py", m[2]) for m in TEST_SPAN.finditer(prose)]
    for rel, name in refs:
        if not (REPO / rel).is_file():
            found.append(f"{rel}: no such test file")
        elif name and not re.search(rf"^(?:(?:async\s+)?def|class)\s+{name}\b|^{name}\s*[:=]",
                                    (REPO / rel).read_text(), re.M):
            found.append(f"{rel}::{name}: not defined there")
    return found


def problems(path: Path, text: str) -> list[str]:
    """Every broken link, unknown command and missing test of the markdown ``text`` of a page at ``path``."""
    prose, shell = _split_fenced(text)
    found = link_problems(path, prose) + named_test_problems(prose)
    for argv, full in commands(prose, shell):
        p = command_problem(argv, full)
        if p:
            found.append(p)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_and_commands_exist(page):
    assert problems(page, page.read_text()) == []


NEGATIVE = {
    "missing file": ("See [the guide](no-such-page.md).", "no-such-page.md"),
    "missing anchor": ("See [params](params.md#no-such-heading).", "#no-such-heading"),
    "missing anchor here": ("See [above](#nowhere).", "#nowhere"),
    "unknown module": ("```bash\npython -m detpipe.no_such_module --help\n```", "detpipe.no_such_module"),
    "missing script": ("Run `python benchmarks/no_such.py`.", "benchmarks/no_such.py"),
    "unknown dvc subcommand": ("Then `dvc exp shw` lists them.", "'shw'"),
    "unknown dvc option": ("```bash\ndvc repro && dvc exp run --no-such-flag\n```", "--no-such-flag"),
    "unknown stage": ("Rerun one stage: `dvc repro trian`.", "trian"),
    "unknown prefect command": ("Retry it: `prefect flow-run retri <id>`.", "retri"),
    "moved test file": ("Proved by `tests/test_cocoeval.py`.", "tests/test_cocoeval.py"),
    "missing test": ("Proved by `stages/test_train::test_no_such_test`.", "test_no_such_test"),
    "missing helper": ("Built by `tests/system/test_workers.py::_team`.", "_team"),
}


@pytest.mark.parametrize("case", sorted(NEGATIVE))
def test_a_broken_link_or_command_is_reported(case):
    """Each kind of breakage in a page is reported, naming what is broken (a page at docs/x.md); the same page
    with the thing fixed has no problem."""
    text, name = NEGATIVE[case]
    found = problems(REPO / "docs" / "x.md", f"# x\n\nIntro.\n\n{text}\n")
    assert len(found) == 1 and name in found[0], found


def test_a_correct_page_has_no_problem():
    text = ("# x\n\nSee [params](params.md#train), [the README](../README.md#use-the-model), [here](#x).\n\n"
            "```bash\ndvc repro && dvc exp run -S train.lr=0.02 --name lr02   # comment\n"
            "PREFECT_SERVER_ANALYTICS_ENABLED=false prefect server start --host 127.0.0.1\n"
            "python -m stages.train --emit k8s --out train.yaml && kubectl apply -f train.yaml\n```\n\n"
            "Mentions: `dvc exp push`, `dvc repro convert`, `prefect flow-run retry <id>`, `python -m stages.<name>`,"
            " `python .dvc/offline-plots/build.py`, `unit/test_docs::test_a_correct_page_has_no_problem`,"
            " `tests/system/test_workers.py::_workers_team`, `tests/support/pipeline.py::TINY_PARAMS`.\n")
    assert problems(REPO / "docs" / "x.md", text) == []


def test_every_page_is_reachable_from_the_readme():
    readme = (REPO / "README.md").read_text()
    orphans = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not orphans, f"docs pages the README does not link: {orphans}"


def test_readme_is_a_landing_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def _nested_models(model) -> list[type]:
    """The pydantic models inside ``model``'s field types (``list[DownloadPart]`` -> DownloadPart), recursively."""
    from pydantic import BaseModel

    found, todo = [], [info.annotation for info in model.model_fields.values()]
    while todo:
        tp = todo.pop()
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            found.append(tp)
            todo.extend(info.annotation for info in tp.model_fields.values())
        else:
            todo.extend(typing.get_args(tp))
    return found


def test_params_reference_lists_every_key():
    """docs/params.md has a table row for every key of every params section, under that section's heading."""
    from detpipe.params import Params

    text = (REPO / "docs" / "params.md").read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    for section, field in Params.model_fields.items():
        assert section in sections, f"docs/params.md has no section {section}"
        rows = set(re.findall(r"^\| `(\w+)` \|", sections[section], re.M))
        keys = set(field.annotation.model_fields)
        for nested in _nested_models(field.annotation):   # e.g. download.source's parts {url, sha256}
            keys |= set(nested.model_fields)
        missing = keys - rows
        assert not missing, f"docs/params.md, {section}: no row for {sorted(missing)}"
        stale = rows - keys
        assert not stale, f"docs/params.md, {section}: rows for keys that do not exist: {sorted(stale)}"


def test_rules_reference_lists_every_rule():
    """Every counted convert rule is in docs/convert.md's table, every stopping one in docs/errors.md's."""
    from detpipe.data.coco_schema import ERRORS, RULES

    convert = (REPO / "docs" / "convert.md").read_text()
    errors = (REPO / "docs" / "errors.md").read_text()
    assert [r for r in RULES if f"`{r}`" not in convert] == []
    assert [r for r in ERRORS if f"`{r}`" not in errors] == []


def params_snippet_problems(text: str) -> list[str]:
    """Problems of the ``yaml`` fenced blocks of a page that hold params.yaml sections: each section must validate
    against its schema (`detpipe.params`; keys left out take their defaults)."""
    from pydantic import ValidationError
    from ruamel.yaml import YAML

    from detpipe.params import Params

    found = []
    for block in re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S):
        doc = YAML(typ="safe", pure=True).load(block)
        for section, value in (doc.items() if isinstance(doc, dict) else []):
            if section not in Params.model_fields:
                found.append(f"yaml block: {section!r} is not a params.yaml section")
                continue
            try:
                Params.model_fields[section].annotation.model_validate(value)
            except ValidationError as e:
                err = e.errors()[0]
                found.append(f"yaml block: {section}.{'.'.join(map(str, err['loc']))}: {err['msg']}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_params_snippets_validate(page):
    assert params_snippet_problems(page.read_text()) == []


def test_a_wrong_params_snippet_is_reported():
    text = "```yaml\ndownload:\n  source: [{url: a.zip, sha: 0}]\nconvert:\n  annotation: a.json\n  images: x\n```\n"
    found = params_snippet_problems(text)
    assert len(found) == 2 and "download.source" in found[0] and "convert.annotation" in found[1], found
