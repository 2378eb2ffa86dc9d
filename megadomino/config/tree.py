"""Config, the root of the configuration tree, and `build`, which makes a section from the nested
dict of fields the command line collects (`{"schedule": {"lr": 3e-4}}`)."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field

from megadomino.config.model import ModelConfig
from megadomino.config.parallel import ParallelConfig
from megadomino.config.train import TrainConfig


@dataclass
class Config:
    """One run: what the network is, how it is laid out across GPUs, how it is trained."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def build(cls: type, fields: dict[str, typing.Any]):
    """`cls(**fields)`, where a field whose type is a dataclass (or a dataclass or None) and whose
    value is a dict is built from that dict first; fields not given keep their defaults."""
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in fields.items():
        section = _dataclass_of(hints[name])
        values[name] = build(section, value) if section and isinstance(value, dict) else value
    return cls(**values)


def _dataclass_of(hint) -> type | None:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return next((t for t in options if dataclasses.is_dataclass(t)), None)
