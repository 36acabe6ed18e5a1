"""The AdamW refusal (a transformers model at SGD's default lr) names exactly what to pass, and passing it works."""
from __future__ import annotations

import shlex

import pytest

from detpipe import params as params_mod
from detpipe.core.errors import StageError
from detpipe.models import optimizer_recipe


@pytest.mark.parametrize("model", ["rtdetr_v2_r18vd", "dfine_n"])
def test_adamw_refusal_names_the_recipe_and_the_recipe_passes(model):
    with pytest.raises(StageError) as e:
        optimizer_recipe(params_mod.Train(model=model))
    msg = str(e.value)
    assert "\n" not in msg and "train.lr=0.05 with AdamW" in msg and model in msg
    args = shlex.split(msg.split("pass ", 1)[1].split(" (", 1)[0])
    overrides = dict(a.removeprefix("train.").split("=") for a in args if a != "-S")
    assert overrides == {"lr": "0.0001", "weight_decay": "0.0001"}
    cfg = params_mod.Train(model=model, **{k: float(v) for k, v in overrides.items()})
    assert optimizer_recipe(cfg)[:2] == ("adamw", 0.1)
