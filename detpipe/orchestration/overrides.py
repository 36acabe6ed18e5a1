"""params.yaml overrides of a run: ``section.key=value`` items (each value read as YAML, as params.yaml is), checked
against the schema of `detpipe.params`, written into a params.yaml with its comments kept (ruamel.yaml round trip).

ruamel.yaml is the project's one YAML library for params.yaml: `detpipe.params.load` reads the file with it (YAML
1.2, as DVC does), `parse` reads override values with the same reader, and `apply` writes with its round trip,
which keeps comments and layout (PyYAML cannot)."""
from __future__ import annotations

import copy
import itertools
import tempfile
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedSeq
from ruamel.yaml.constructor import SafeConstructor
from ruamel.yaml.error import YAMLError

from detpipe import params as params_mod
from detpipe.core.errors import StageError
from detpipe.core.files import atomic_write_bytes


class OverrideError(StageError):
    """An override that is malformed, names no params.yaml key, or breaks the schema; one line."""


class _ValueConstructor(SafeConstructor):
    """The safe loader's constructor with dates kept as text (no param is a date; a date-like run id stays a
    string). A subclass, since ``add_constructor`` changes the registry of the class it is called on."""


_ValueConstructor.add_constructor("tag:yaml.org,2002:timestamp", SafeConstructor.construct_yaml_str)


def parse(items: list[str]) -> dict[str, Any]:
    """``["train.lr=0.01", "train.milestones=[0.5, 0.8]"]`` → ``{"train.lr": 0.01, "train.milestones": [0.5,
    0.8]}``. Each value is read as YAML 1.2 (ruamel.yaml's safe loader, as `detpipe.params.load` reads params.yaml,
    so a value means what the same text means in the file): numbers (``1e-3`` too), ``true``/``false``, ``null``
    or nothing, ``[...]`` lists, ``{...}`` mappings; anything else is a string (``off``, ``yes``, ``24:00:00``,
    ``2:4``, and dates such as ``2024-05-01``: no param is a date). Items are grouped by section in the order
    sections first appear (a later item for the same key wins); ``train={lr: 0.01}`` is ``train.lr=0.01``.

    Raises:
        OverrideError: an item without ``=``, a value that is not YAML (e.g. ``[0.5,``), or a key that is not
            ``section.key`` of `detpipe.params.Params` (`normalize`).
    """
    for item in items:
        if "=" not in item or not item.partition("=")[0].strip():
            raise OverrideError(f"override '{item}': expected section.key=value, e.g. train.lr=0.01")
    reader = YAML(typ="safe", pure=True)
    reader.Constructor = _ValueConstructor
    nested: dict[str, Any] = {}
    for item in items:
        key, _, text = item.partition("=")
        try:
            value = reader.load(text)
        except YAMLError as e:
            raise OverrideError(f"override '{item}': the value is not YAML: {str(e).strip().splitlines()[0]}") from None
        section, dot, name = key.partition(".")
        if dot:
            if not isinstance(nested.get(section), dict):
                nested[section] = {}
            nested[section][name] = value
        elif isinstance(value, dict) and isinstance(nested.get(section), dict):
            nested[section].update(value)
        else:
            nested[section] = value
    return normalize(nested)


def normalize(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Flatten ``{"train": {"lr": 0.01}}`` to ``{"train.lr": 0.01}``; dotted keys pass through.

    Raises:
        OverrideError: a key that is not ``section.key`` of `detpipe.params.Params`.
    """
    flat: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if "." not in key and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    sections = params_mod.Params.model_fields
    for key in flat:
        section, _, name = key.partition(".")
        if section not in sections or name not in sections[section].annotation.model_fields:
            raise OverrideError(f"override '{key}': not a params.yaml key (expected section.key, e.g. train.lr; "
                                f"sections: {', '.join(sections)})")
    return flat


def expand(grid: dict[str, Any] | None, runs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A sweep's override sets: every combination of ``grid``'s list values (``{"train.lr": [0.01, 0.02]}``;
    scalar values are fixed in every set), then each of ``runs`` merged over the grid's fixed values. Keys are
    normalized (`normalize`); duplicate sets are dropped, order kept. A list-valued param (``train.milestones``)
    is swept as an axis, so pass a fixed list inside ``runs``.

    Raises:
        OverrideError: a bad key, or no set at all.
    """
    grid = normalize(grid)
    axes = {k: v for k, v in grid.items() if isinstance(v, list)}
    fixed = {k: v for k, v in grid.items() if k not in axes}
    sets = [fixed | dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] if axes else []
    sets += [fixed | normalize(r) for r in runs or []]
    unique = [s for i, s in enumerate(sets) if s not in sets[:i]]
    if not unique:
        raise OverrideError("a sweep needs a grid with at least one list of values, or a list of runs")
    return unique


def json_schema() -> dict:
    """JSON schema of the ``overrides`` parameter: an object whose optional properties are the dotted
    params.yaml keys (``"train.lr"``) with `detpipe.params.Params`' per-key schema (type, bounds, enums; no
    defaults), and no other keys."""
    full = params_mod.Params.model_json_schema()
    defs = full.get("$defs", {})
    props: dict[str, dict] = {}
    for section, ref in full["properties"].items():
        sec = defs[ref["$ref"].rsplit("/", 1)[-1]]
        for key, schema in sec["properties"].items():
            schema = {k: v for k, v in copy.deepcopy(schema).items() if k not in ("default", "title")}
            props[f"{section}.{key}"] = {"title": f"{section}.{key}", **schema}
    return {"anyOf": [{"type": "object", "properties": props, "additionalProperties": False}, {"type": "null"}],
            "default": None, "title": "overrides",
            "description": 'params.yaml overrides for this run, e.g. {"train.lr": 0.01}; the run is saved as a '
                           "DVC experiment named after the flow run"}


def _yaml_rt():
    rt = YAML()  # round trip: comments and layout of untouched keys are kept
    rt.preserve_quotes = True
    rt.width = 4096
    rt.representer.add_representer(
        type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))  # not an empty value
    return rt


def apply(params_file: Path, overrides: dict[str, Any]) -> bytes:
    """Write ``overrides`` (``{"section.key": value}``) into ``params_file``, keeping its comments, after
    checking that the result passes `detpipe.params.load`. Returns the file's previous bytes.

    Raises:
        OverrideError: the overridden params break the schema (the message names the key and value); the file
            is then left unchanged.
    """
    original = params_file.read_bytes()
    rt = _yaml_rt()
    data = rt.load(original.decode())
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if isinstance(value, list):
            value = CommentedSeq(value)
            value.fa.set_flow_style()
        data[section][name] = value
    with tempfile.TemporaryDirectory() as tmp:
        candidate = Path(tmp) / params_file.name
        with open(candidate, "w") as f:
            rt.dump(data, f)
        try:
            params_mod.load(path=candidate)
        except StageError as e:
            raise OverrideError(f"overrides {overrides}: {str(e).replace(str(candidate), params_file.name)}") from None
        atomic_write_bytes(params_file, candidate.read_bytes())
    return original
