"""A run's config as the benches read it: the experiment file (`experiments/sao.py:tiny`), the `--set` overrides a
bench takes, and the model architecture the trainer builds from it."""
from __future__ import annotations

import ast
import importlib.util

import ml_collections

from mercury_jax.config.model import preset_config


def load_config(path: str) -> ml_collections.ConfigDict:
    """`get_config(variant)` of the experiment file `path` ("FILE" or "FILE:VARIANT")."""
    file, _, variant = path.partition(":")
    spec = importlib.util.spec_from_file_location("_aot_config", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant or None)


def apply_overrides(config, items: list[str]) -> None:
    """`--set a.b=VALUE` for each item: a Python literal (a dict becomes a ConfigDict; a field may be new), cast to
    the type of the scalar it replaces (a bool from "True"), else the bare string."""
    for item in items:
        field, _, text = item.partition("=")
        *path, name = field.split(".")
        section = config
        for key in path:
            section = section[key]
        old = section.get(name)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        if isinstance(value, dict):
            value = ml_collections.ConfigDict(value)
        elif isinstance(old, bool):
            value = text == "True"
        elif old is not None and not isinstance(old, ml_collections.ConfigDict):
            value = type(old)(value)
        section[name] = value


def model_config(config, preset: str):
    """The run's model architecture as the trainer builds it (`config/model.py:preset_config`): its preset (the
    `:tiny` overrides included) or, for a run that loads an HF checkpoint, `preset` (the checkpoint's architecture:
    shapes need no weights)."""
    return preset_config(config.model, config.tokenizer.vocab_size, config.model.get("preset") or preset)
