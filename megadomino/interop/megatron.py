"""Megatron-LM checkpoints: which of their tensors is which of ours, which format a directory
holds, and reading the legacy `torch` format without megatron installed.

Names. megatron-core's GPTModel names its tensors as ours are named, except:

    ours                                   megatron-core
    word_embeddings.weight                 embedding.word_embeddings.weight
    position_embeddings.weight             embedding.position_embeddings.weight
    output_weight                          output_layer.weight
    decoder.layers.i.input_layernorm.*     decoder.layers.i.self_attention.linear_qkv.layer_norm_*
    decoder.layers.i.pre_mlp_layernorm.*   decoder.layers.i.mlp.linear_fc1.layer_norm_*

(right: the Transformer Engine spec, whose linears hold the norm before them, and every
`torch_dist` checkpoint whatever the spec; the local spec's state dict keeps our names). The
tensors' layouts are ours (tests/test_peers.py): the fused QKV holds per query group its query
heads, then its key head, then its value head; SwiGLU's linear_fc1 stacks gate over up, each
split over TP on its own; the vocabulary is padded with rows past vocab_size. So a Megatron
TP shard is our shard at that TP, and its full tensor is ours plus padding rows.

Formats of an iteration directory (`iter_0000010/`):
- `torch_dist`: `metadata.json` names the backend; `.metadata` and `__*_*.distcp` are a
  torch.distributed.checkpoint directory of full (unsharded, padded) tensors, layers stacked
  along a leading dim under `decoder.layers.<name>` (or one key per layer); `common.pt` holds the
  rest (`iteration`, `args`). Read and written by `megatron_dist`.
- `torch` (legacy): `mp_rank_TT[_PPP]/model_optim_rng.pt` per TP rank TT and pipeline stage PPP,
  each a pickle of `model` (the stage's local state dict: layers numbered from 0 on each stage),
  `args` (an argparse Namespace), `iteration`, `checkpoint_version`, `optimizer`, `rng_state`.

Pickles written by Megatron-LM reference its classes (enums in `args`, the optimizer config);
`load_pickle` loads them with a restricted unpickler that imports nothing the file names: torch's
tensor rebuilds, plain containers and argparse Namespaces are themselves, every other global an
inert `StandIn` that runs no code. So megatron need not be installed, and nothing in the file is
executed whether it is or not.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import copyreg
import importlib
import json
import pickle
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LEGACY_FILE = "model_optim_rng.pt"
DIST_METADATA = "metadata.json"
LAYER_PREFIX = "decoder.layers."
_RENAMED = {
    "word_embeddings.weight": "embedding.word_embeddings.weight",
    "position_embeddings.weight": "embedding.position_embeddings.weight",
    "output_weight": "output_layer.weight",
}
_NORM_IN_LINEAR = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
_TRUSTED = (argparse.Namespace, types.SimpleNamespace)
"""Plain containers Megatron-LM pickles (`args`) that are kept as themselves."""
_SAFE_BUILTINS = {"collections.OrderedDict": collections.OrderedDict,
                  "_codecs.encode": codecs.encode,  # how protocol 2 pickles bytes
                  "copyreg._reconstructor": copyreg._reconstructor,
                  **{f"builtins.{cls.__name__}": cls
                     for cls in (set, frozenset, slice, complex, object, int, float, str, bytes,
                                 bytearray, tuple, list, dict, bool)}}
"""Globals a plain pickle uses to rebuild builtin values (copyreg._reconstructor only builds an
object of a class find_class already returned)."""
_SHARD_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")


class MegatronCheckpointError(ValueError):
    """A Megatron-LM checkpoint that cannot be read; the message names the file or tensor."""


class StandIn:
    """An object of a class the pickle names but we do not import: it keeps what it was built
    from (`args`, `state`) and does nothing else."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"StandIn({type(self).__qualname__}{self.args!r})"


def load_pickle(path: Path, mmap: bool = True) -> Any:
    """The object torch.save wrote to `path`, unpickled by `restricted_unpickler`: torch's
    tensors and storages, plain containers and argparse Namespaces as themselves, every other
    global (megatron's classes among them) as an inert StandIn subclass of its name."""
    pickle_module = types.ModuleType("megadomino_restricted_pickle")
    pickle_module.Unpickler = restricted_unpickler()
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap,
                          pickle_module=pickle_module)
    except Exception as err:
        raise MegatronCheckpointError(f"{path} is unreadable (truncated or corrupt?): "
                                      f"{err}") from None


def restricted_unpickler() -> type[pickle.Unpickler]:
    """An Unpickler class that imports nothing: `find_class` returns torch's tensor-rebuild
    functions, dtypes and Size, `_TRUSTED` containers and `_SAFE_BUILTINS`, and for any other
    name a StandIn subclass made once per unpickler (so a name keeps one class), never the
    named object, whether or not its module is installed."""

    class RestrictedUnpickler(pickle.Unpickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.stand_ins: dict[str, type] = {}

        def find_class(self, module: str, name: str) -> Any:
            trusted = _trusted_global(module, name)
            if trusted is not None:
                return trusted
            key = f"{module}.{name}"
            if key not in self.stand_ins:
                self.stand_ins[key] = type(name, (StandIn,), {"__module__": module,
                                                             "__qualname__": name})
            return self.stand_ins[key]

    return RestrictedUnpickler


def _trusted_global(module: str, name: str) -> Any:
    """The real object for the few globals a torch.save'd state dict needs, else None."""
    if f"{module}.{name}" in _SAFE_BUILTINS:
        return _SAFE_BUILTINS[f"{module}.{name}"]
    for cls in _TRUSTED:
        if (cls.__module__, cls.__qualname__) == (module, name):
            return cls
    if module not in ("torch", "torch._utils", "torch._tensor") or "." in name:
        return None
    found = getattr(importlib.import_module(module), name, None)
    if name.startswith("_rebuild") or isinstance(found, torch.dtype) or found is torch.Size:
        return found
    return None


def megatron_names(ours: str) -> tuple[str, ...]:
    """Megatron-core's names for our parameter `ours`, per layer (`decoder.layers.i.`): the
    Transformer Engine / torch_dist name first, then the local spec's where it differs."""
    if ours in _RENAMED:
        return (_RENAMED[ours],)
    if not ours.startswith(LAYER_PREFIX):
        return (ours,)
    index, _, rest = ours[len(LAYER_PREFIX):].partition(".")
    for norm, fused in _NORM_IN_LINEAR.items():
        if rest.startswith(norm):
            return (f"{LAYER_PREFIX}{index}.{fused}{rest[len(norm):]}", ours)
    return (ours,)


def split_layer(name: str) -> tuple[str, int | None]:
    """'decoder.layers.3.mlp.linear_fc2.weight' -> ('decoder.layers.mlp.linear_fc2.weight', 3);
    a name outside the layers -> (name, None)."""
    if not name.startswith(LAYER_PREFIX):
        return name, None
    index, _, rest = name[len(LAYER_PREFIX):].partition(".")
    return LAYER_PREFIX + rest, int(index)


def megatron_format(iteration_dir: Path) -> str | None:
    """'torch_dist' or 'torch' when `iteration_dir` holds a Megatron-LM checkpoint of that
    format, None when it does not: a megadomino checkpoint (its shards have a `format` entry;
    it may carry torch_dist files beside them, for Megatron-LM), or no checkpoint."""
    shards = sorted(iteration_dir.glob(f"mp_rank_*/{LEGACY_FILE}"))
    if shards:
        content = load_pickle(shards[0])
        return "torch" if isinstance(content, dict) and "format" not in content else None
    metadata = iteration_dir / DIST_METADATA
    if metadata.exists():
        try:
            backend = json.loads(metadata.read_text()).get("sharded_backend")
        except (json.JSONDecodeError, AttributeError):
            raise MegatronCheckpointError(f"{metadata} is not Megatron's metadata.json") from None
        if backend != "torch_dist":
            raise MegatronCheckpointError(
                f"{metadata}: a Megatron-LM {backend!r} checkpoint; only torch_dist and torch "
                "are read (convert it with Megatron-LM's --ckpt-convert-format torch_dist)")
        return "torch_dist"
    return None


@dataclass
class LegacyCheckpoint:
    """The model state dicts of a legacy `torch` checkpoint: `models[pp][tp]` (memory-mapped),
    and the first file's `iteration` and `args`."""

    directory: Path
    models: list[list[dict[str, Any]]]
    iteration: int
    args: Any

    @classmethod
    def read(cls, iteration_dir: Path) -> LegacyCheckpoint:
        files = {}
        for path in iteration_dir.glob(f"mp_rank_*/{LEGACY_FILE}"):
            match = _SHARD_DIR.fullmatch(path.parent.name)
            if match is None:
                continue
            if match.group(3) is not None and int(match.group(3)):
                raise MegatronCheckpointError(f"{path}: expert-parallel checkpoints are not read")
            files[(int(match.group(2) or 0), int(match.group(1)))] = path
        pp = 1 + max(stage for stage, _ in files)
        tp = 1 + max(rank for _, rank in files)
        missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                   for p in range(pp) for t in range(tp) if (p, t) not in files]
        if missing:
            raise MegatronCheckpointError(f"{iteration_dir}: shards missing: {missing} (saved at "
                                          f"tensor-parallel {tp} x pipeline-parallel {pp})")
        models, head = [], None
        for stage in range(pp):
            models.append([])
            for rank in range(tp):
                content = load_pickle(files[(stage, rank)])
                if "model" not in content:
                    raise MegatronCheckpointError(
                        f"{files[(stage, rank)]} holds no 'model' (virtual pipeline stages, "
                        f"{sorted(k for k in content if k.startswith('model'))}, are not read)")
                head = head or content
                models[stage].append(content["model"])
        return cls(iteration_dir, models, int(head.get("iteration", 0)), head.get("args"))

    def global_names(self) -> dict[str, tuple[int, str]]:
        """Every tensor name with layers numbered across stages -> (stage, its local name).
        A stage's layers follow the previous stages' (counted from their keys)."""
        located, offset = {}, 0
        for stage, ranks in enumerate(self.models):
            layers = set()
            for name, value in ranks[0].items():
                if not isinstance(value, torch.Tensor):
                    continue
                base, layer = split_layer(name)
                if layer is None:
                    located.setdefault(name, (stage, name))
                    continue
                layers.add(layer)
                located[f"{LAYER_PREFIX}{offset + layer}.{base[len(LAYER_PREFIX):]}"] = (stage,
                                                                                         name)
            offset += len(layers)
        return located

    def shards(self, stage: int, name: str) -> list[torch.Tensor]:
        """The tensor `name` of `stage` in every TP rank, in rank order."""
        return [state[name] for state in self.models[stage]]
