"""Tests' shorthand for the configuration tree: `make_config(model, lr=..., stage=1)` puts each
keyword in the one section that has a field of that name (every leaf name of
megadomino.config.Config is unique; leaf_paths checks it), so a test names only what it changes;
`with_leaves(config, ...)` replaces fields the same way."""

from __future__ import annotations

import dataclasses
import typing

from megadomino.config import Config, FP8Recipe, ModelConfig, ParallelConfig, TrainConfig, build
from megadomino.config.tree import _dataclass_of


def leaf_paths(cls: type = Config, path: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """Every leaf field of the tree under `cls`, by name -> its path."""
    paths: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        section = _dataclass_of(hints[field.name])
        if section is not None:
            for name, sub in leaf_paths(section, path + (field.name,)).items():
                assert name not in paths, f"leaf {name} is ambiguous"
                paths[name] = sub
        else:
            assert field.name not in paths, f"leaf {field.name} is ambiguous"
            paths[field.name] = path + (field.name,)
    return paths


def _nested(cls: type, leaves: dict[str, typing.Any]) -> dict:
    paths, fields = leaf_paths(cls), {}
    for name, value in leaves.items():
        if name not in paths:
            raise TypeError(f"{cls.__name__} has no field {name!r}")
        *sections, leaf = paths[name]
        target = fields
        for section in sections:
            target = target.setdefault(section, {})
        target[leaf] = value
    return fields


def make_config(model: ModelConfig | None = None, **leaves) -> Config:
    """Config(model, ...) with `leaves` (parallel and train fields by their names) set."""
    fields = _nested(Config, leaves)
    if "model" in fields:
        raise TypeError(f"architecture fields {sorted(fields['model'])}: pass a ModelConfig")
    return dataclasses.replace(build(Config, fields), model=model or ModelConfig())


def with_leaves(config, **leaves):
    """`config` (a Config or one of its sections) with `leaves` replaced, by their names."""
    return _replace(config, _nested(type(config), leaves))


def _replace(section, fields: dict):
    changes = {}
    for name, value in fields.items():
        current = getattr(section, name)
        if isinstance(value, dict):
            value = (_replace(current, value) if current is not None
                     else build(_dataclass_of(typing.get_type_hints(type(section))[name]), value))
        changes[name] = value
    return dataclasses.replace(section, **changes)


def train_config(**leaves) -> TrainConfig:
    return build(TrainConfig, _nested(TrainConfig, leaves))


def parallel_config(**leaves) -> ParallelConfig:
    return build(ParallelConfig, _nested(ParallelConfig, leaves))


def layer_options(fields: dict) -> tuple[dict, ParallelConfig, FP8Recipe | None]:
    """Split `fields` into ModelConfig's fields, a ParallelConfig of the parallel leaves given
    (sequence_parallel, batch_slices, recompute_granularity, ...) and an FP8Recipe of the FP8
    leaves given (format, recipe, ...; None when none is)."""
    fields = dict(fields)
    parallel = {name: fields.pop(name) for name in list(fields)
                if name in leaf_paths(ParallelConfig)}
    fp8 = {name: fields.pop(name) for name in list(fields)
           if name in FP8Recipe.__dataclass_fields__}
    return fields, parallel_config(**parallel), FP8Recipe(**fp8) if fp8 else None


EXECUTIONS = {
    "plain": {},
    "recompute": dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1),
    "domino 2x2": dict(batch_slices=2, hidden_slices=2),
    "domino unsliced": dict(explicit_backward=True),
}
"""The ways the layer stack runs on CPU, as parallel_config leaves: plain, full recompute (a
runner of its own), Domino sliced (2 batch x 2 hidden slices) and unsliced."""
