"""Which model library ("family") builds a model: the lookups every stage asks (`family_of` by ``train.model``
name, `family_of_model` by a built model) instead of testing a model's name or class itself.

Two families today: torchvision's detection builders (`detpipe.models.torchvision_family`) and Hugging Face
transformers' real-time DETRs (`detpipe.models.transformers_family`). What a family declares is
`detpipe.models.registry.Family`; the family modules register into `detpipe.models.registry` (they do not import
this module), and this module imports them when first asked, so no module imports back. Importing this module
imports neither library (params validation uses it).
"""
from __future__ import annotations

from detpipe.models.registry import Family, registered, registered_names


def _load() -> list[Family]:
    from detpipe.models import torchvision_family, transformers_family  # noqa: F401  (importing registers them)
    return registered()


def all_model_names() -> list[str]:
    """Every ``train.model`` name of every family (sorted)."""
    _load()
    return registered_names()


def family_of(name: str) -> Family:
    """The family that builds ``train.model`` ``name`` (torchvision's for any name no other family owns, so an
    unknown name fails in torchvision's builder with the list of names)."""
    for fam in _load():
        if fam.owns(name):
            return fam
    return _load()[-1]


def family_of_model(model) -> Family:
    """The family of a built model: by the ``_detpipe_name`` `detpipe.models.build_from_config` sets, else by the
    model's class (a transformers-family wrapper says so), else torchvision's."""
    name = getattr(model, "_detpipe_name", None) or getattr(model, "detpipe_model_name", None)
    return family_of(name) if name else _load()[-1]
