"""Import and export Hugging Face Llama checkpoints (config.json + safetensors) at any TP and PP
degree.

    model = load_llama("Llama-2-7b-hf", dims, params_dtype="bfloat16", seq_length=4096)
    save_llama(model, "out/llama-hf")        # collective; TP rank 0 of each stage writes
    load_llama_weights(stage, "Llama-2-7b-hf")   # into a built model or pipeline stage

A pipeline stage (`checkpoint_parameters`: the whole model's names) loads its layers' HF
tensors; at export each stage's writer writes its own files (none holds two stages' tensors).

One table, `weight_layout`, says how each of our unsharded tensors is made of rows of HF tensors
(the fused QKV interleaves q, k and v per query group; fc1 stacks gate over up); loading and saving
both read it, so the two directions cannot disagree. HF's rotary embedding is rotate-half, as ours,
so q and k rows need no permutation.

Memory: loading reads from the safetensors files only the rows and columns of this rank's shards
(`safe_open` slices), never a full checkpoint. Saving gathers one parameter at a time over TP and
rank 0 keeps at most one output file's tensors before writing it.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megadomino.build import build_model
from megadomino.config import ConfigError, FP8Recipe, ModelConfig, ParallelConfig
from megadomino.distributed import comm
from megadomino.interop.hf_config import hf_config_from, model_config_from_hf
from megadomino.models.blocks import DTYPES
from megadomino.models.gpt import full_shape, gather_full
from megadomino.models.llama import LlamaModel

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)
"""Buffers some HF checkpoints carry that we recompute."""


@dataclass(frozen=True)
class RowBlock:
    """Rows [start, stop) of the HF tensor `name`: one block of one of our tensors' rows."""

    name: str
    start: int
    stop: int


def weight_layout(config: ModelConfig) -> dict[str, list[RowBlock]]:
    """Our full_state_dict names -> the HF row blocks stacked (dim 0) to form each tensor.

    Megatron's fused QKV holds, per query group g, its heads_per_group q heads, then one k head,
    then one v head (kv_channels rows each); a group's q heads are contiguous rows of q_proj."""
    d, groups = config.kv_channels, config.num_query_groups
    q_rows = config.num_attention_heads // groups * d
    hidden, ffn = config.hidden_size, config.ffn_hidden_size

    def whole(name: str, rows: int) -> list[RowBlock]:
        return [RowBlock(name, 0, rows)]

    layout = {"word_embeddings.weight": whole("model.embed_tokens.weight", config.vocab_size)}
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = []
        for g in range(groups):
            qkv += [RowBlock(hf + "self_attn.q_proj.weight", g * q_rows, (g + 1) * q_rows),
                    RowBlock(hf + "self_attn.k_proj.weight", g * d, (g + 1) * d),
                    RowBlock(hf + "self_attn.v_proj.weight", g * d, (g + 1) * d)]
        layout.update({
            ours + "input_layernorm.weight": whole(hf + "input_layernorm.weight", hidden),
            ours + "self_attention.linear_qkv.weight": qkv,
            ours + "self_attention.linear_proj.weight": whole(hf + "self_attn.o_proj.weight",
                                                              hidden),
            ours + "pre_mlp_layernorm.weight": whole(hf + "post_attention_layernorm.weight",
                                                     hidden),
            ours + "mlp.linear_fc1.weight": whole(hf + "mlp.gate_proj.weight", ffn)
            + whole(hf + "mlp.up_proj.weight", ffn),
            ours + "mlp.linear_fc2.weight": whole(hf + "mlp.down_proj.weight", hidden),
        })
    layout["decoder.final_layernorm.weight"] = whole("model.norm.weight", hidden)
    layout["output_weight"] = whole("lm_head.weight", config.vocab_size)
    return layout


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint for `config`, with its shape."""
    d, hidden = config.kv_channels, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for i in range(config.num_layers):
        hf = f"model.layers.{i}."
        shapes.update({
            hf + "input_layernorm.weight": (hidden,),
            hf + "self_attn.q_proj.weight": (config.num_attention_heads * d, hidden),
            hf + "self_attn.k_proj.weight": (config.num_query_groups * d, hidden),
            hf + "self_attn.v_proj.weight": (config.num_query_groups * d, hidden),
            hf + "self_attn.o_proj.weight": (hidden, config.num_attention_heads * d),
            hf + "post_attention_layernorm.weight": (hidden,),
            hf + "mlp.gate_proj.weight": (config.ffn_hidden_size, hidden),
            hf + "mlp.up_proj.weight": (config.ffn_hidden_size, hidden),
            hf + "mlp.down_proj.weight": (hidden, config.ffn_hidden_size),
        })
    return shapes


class SafetensorsReader:
    """Slices of the tensors of an HF directory: `model.safetensors`, or shards named by
    `model.safetensors.index.json`. Files are opened lazily and only headers are read eagerly."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self._safe_open = safe_open
        index_path = os.path.join(hf_dir, SAFETENSORS_INDEX)
        single_path = os.path.join(hf_dir, SAFETENSORS_FILE)
        if os.path.exists(index_path):
            weight_map = _read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{index_path} has no weight_map: is it a safetensors index?")
            self.files = {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
        elif os.path.exists(single_path):
            with self._open(single_path) as handle:
                self.files = dict.fromkeys(handle.keys(), single_path)
        else:
            raise ConfigError(f"{hf_dir} holds neither {SAFETENSORS_FILE} nor "
                              f"{SAFETENSORS_INDEX} (only safetensors checkpoints are read)")
        for path in sorted(set(self.files.values())):
            if not os.path.isfile(path):
                raise ConfigError(f"{path} is named by {SAFETENSORS_INDEX} but missing: "
                                  "download or copy the checkpoint's every shard")
        self._handles: dict[str, Any] = {}

    def _open(self, path: str):
        from safetensors import SafetensorError

        try:
            return self._safe_open(path, framework="pt")
        except (SafetensorError, OSError) as err:
            raise ConfigError(f"{path} is not a readable safetensors file ({err}): truncated "
                              "or corrupt? re-download or re-save it") from None

    def _slice(self, name: str):
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._open(path)
        return self._handles[path].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, start: int, stop: int, columns: slice) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (and `columns`, for a matrix)."""
        tensor_slice = self._slice(name)
        if len(tensor_slice.get_shape()) == 1:
            return tensor_slice[start:stop]
        return tensor_slice[start:stop, columns]


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{path} not found: is {hf_dir} a Hugging Face model directory?")
    return _read_json(path)


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from `path`; ConfigError naming the file and the position otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except ValueError as err:  # not JSON, or not UTF-8 text
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    except OSError as err:
        raise ConfigError(f"{path} cannot be read: {err.strerror}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def load_llama(hf_dir: str, dims, params_dtype: str | torch.dtype | None = None,
               device: torch.device | str | None = None, *,
               parallel: ParallelConfig | None = None, fp8: FP8Recipe | None = None,
               **config_overrides: Any) -> LlamaModel:
    """A LlamaModel holding this rank's shards of the HF Llama checkpoint in `hf_dir`, built by
    the one builder (megadomino.build.build_model, family 'llama') and then filled.

    `params_dtype`: 'float32' (default), 'bfloat16', 'float16' or the torch dtype. `device`: the
    model's default (the current CUDA device, else CPU) when None. `parallel` and `fp8`: how its
    layers run (build_model's: with the runner `parallel` asks for). Keyword `config_overrides`
    replace ModelConfig fields (seq_length, ...). Not collective: each rank reads its own
    slices. Raises ConfigError for an unsupported config, a missing or unreadable file, a missing
    tensor or a shape that contradicts config.json (naming the file or tensor;
    `check_hf_checkpoint` reads headers)."""
    if isinstance(params_dtype, torch.dtype):
        params_dtype = {dtype: name for name, dtype in DTYPES.items()}[params_dtype]
    if params_dtype is not None:
        config_overrides["params_dtype"] = params_dtype
    config = model_config_from_hf(read_hf_config(hf_dir), **config_overrides)
    reader = SafetensorsReader(hf_dir)
    _check_tensors(reader, config, hf_dir)
    model = build_model(config, dims, "llama", device, parallel=parallel, fp8=fp8)
    _copy_weights(model, reader)
    return model


def check_hf_checkpoint(hf_dir: str, config: ModelConfig, flag: str = "--hf-checkpoint") -> None:
    """ConfigError naming `flag` and the file unless `hf_dir` holds readable safetensors files
    with exactly `config`'s tensors at its shapes. Reads headers only, so every rank runs it
    before any process group: a shard missing or cut short, or shape flags or a tokenizer that
    contradict the tensors, are then one line, not one rank's traceback mid-load."""
    try:
        _check_tensors(SafetensorsReader(hf_dir), config, hf_dir)
    except ConfigError as err:
        raise ConfigError(f"{flag}: {err}") from None


def load_llama_weights(model: nn.Module, hf_dir: str) -> None:
    """Fill `model` (a LlamaModel or a pipeline stage of one) with this rank's shards of the HF
    checkpoint in `hf_dir` (exactly `model.config`'s tensors). Not collective; raises as
    load_llama."""
    reader = SafetensorsReader(hf_dir)
    _check_tensors(reader, model.config, hf_dir)
    _copy_weights(model, reader)


def _copy_weights(model: nn.Module, reader: SafetensorsReader) -> None:
    config, layout = model.config, weight_layout(model.config)
    with torch.no_grad():
        for name, param in model.checkpoint_parameters():
            param.copy_(_read_shard(reader, layout[name], param, model.dims)
                        - _norm_offset(config, name))


def _norm_offset(config: ModelConfig, name: str) -> float:
    """What our tensor `name` lacks of HF's: 1 for a norm weight kept as gamma - 1
    (--apply-layernorm-1p; HF stores gamma), else 0."""
    return 1.0 if config.apply_layernorm_1p and name.endswith("layernorm.weight") else 0.0


def _check_tensors(reader: SafetensorsReader, config: ModelConfig, hf_dir: str) -> None:
    expected = hf_shapes(config)
    present = {name for name in reader.files if not name.endswith(IGNORED_HF_SUFFIXES)}
    missing = sorted(set(expected) - present)
    if missing:
        raise ConfigError(f"{hf_dir}: tensors missing from the checkpoint: {missing}")
    unexpected = sorted(present - set(expected))
    if unexpected:
        raise ConfigError(f"{hf_dir}: tensors config.json does not account for: {unexpected}")
    for name, shape in expected.items():
        if reader.shape(name) != shape:
            raise ConfigError(f"{hf_dir}: {name} has shape {reader.shape(name)} but the model "
                              f"config (config.json and its overrides: shape flags, the "
                              f"tokenizer's vocabulary) implies {shape}")


def _read_shard(reader: SafetensorsReader, blocks: list[RowBlock], param: torch.Tensor,
                dims) -> torch.Tensor:
    """This rank's shard of the tensor stacked from `blocks`, as `shard_full` would cut it: rows
    (each of `tp_stripes` stacked blocks split alone, the vocabulary padded with zero rows) or
    columns, read slice by slice."""
    full = full_shape(param, dims)
    if not getattr(param, "tensor_model_parallel", False):
        return _read_rows(reader, blocks, 0, full[0], slice(None))
    if param.tp_partition_dim == 1:
        width = param.shape[1]
        return _read_rows(reader, blocks, 0, full[0],
                          slice(dims.tp_rank * width, (dims.tp_rank + 1) * width))
    stripe_rows = param.shape[0] * dims.tp // param.tp_stripes
    local = stripe_rows // dims.tp
    parts = []
    for stripe in range(param.tp_stripes):
        start = stripe * stripe_rows + dims.tp_rank * local
        stop = min(start + local, full[0])
        rows = _read_rows(reader, blocks, start, stop, slice(None)) if stop > start else \
            torch.empty(0, *full[1:])
        padding = local - rows.shape[0]
        parts.append(torch.nn.functional.pad(rows, (0, 0, 0, padding)) if padding else rows)
    return torch.cat(parts)


def _read_rows(reader: SafetensorsReader, blocks: list[RowBlock], start: int, stop: int,
               columns: slice) -> torch.Tensor:
    """Rows [start, stop) of the stacked tensor made of `blocks`."""
    parts, offset = [], 0
    for block in blocks:
        rows = block.stop - block.start
        lo, hi = max(start, offset), min(stop, offset + rows)
        if lo < hi:
            parts.append(reader.read(block.name, block.start + lo - offset,
                                     block.start + hi - offset, columns))
        offset += rows
    return torch.cat(parts)


def save_llama(model: nn.Module, out_dir: str, dtype: str | None = None,
               max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `model` (a LlamaModel, or this rank's pipeline stage of one) as an HF Llama
    directory: config.json and safetensors, split into `model-0000i-of-0000n.safetensors` files
    of at most `max_shard_bytes` (one tensor may exceed it; no file holds two stages' tensors)
    with `model.safetensors.index.json` when it does not fit one file.

    Collective over the world: every rank calls it; the TP group at DP rank 0 of each stage
    gathers its parameters one at a time and its TP rank 0 writes that stage's files (rank 0
    config.json and the index); all ranks return once the files are complete, or all raise the
    same OSError when a writer could not write. `dtype` defaults to the model's params_dtype."""
    config, dims = model.config, model.dims
    dtype = dtype or config.params_dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    named = [(name, param) for name, param in model.checkpoint_parameters()
             if not getattr(param, "pipeline_duplicate", False)]
    files = _plan_files(config, _stage_orders([name for name, _ in named], dims),
                        DTYPES[dtype], max_shard_bytes)
    error = None
    if dims.dp_rank == 0:
        error = _write_weights(named, config, dims, out_dir, DTYPES[dtype], files)
    if dims.rank == 0 and error is None:
        try:
            with open(os.path.join(out_dir, "config.json"), "w") as f:
                json.dump(hf_config_from(config, dtype), f, indent=2)
        except OSError as err:
            error = f"rank 0 could not write {out_dir}/config.json: {err}"
    if dist.is_initialized():
        # Also the barrier: no rank returns before the files are complete.
        error = next((e for e in comm.all_gather_object(error) if e is not None), None)
    if error is not None:
        raise OSError(f"save_llama: {error}")


def _stage_orders(order: list[str], dims) -> list[list[str]]:
    """Every stage's parameter names, stage by stage (at PP > 1 collective over the world)."""
    if dims.pp == 1:
        return [order]
    by_stage = dict(sorted(comm.all_gather_object((dims.pp_rank, order))))
    return [by_stage[stage] for stage in range(dims.pp)]


def _write_weights(named: list[tuple[str, nn.Parameter]], config: ModelConfig, dims,
                   out_dir: str, dtype: torch.dtype, files: dict[str, str]) -> str | None:
    """Gather every parameter of `named` (collective over TP); TP rank 0 writes the files
    they fill as they complete, rank 0 the index. After a failed write the gathers go on (the
    other TP ranks are in them) and the error is returned."""
    from safetensors.torch import save_file

    layout, shapes = weight_layout(config), hf_shapes(config)
    tensors_per_file = Counter(files.values())
    pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    writes, error = dims.tp_rank == 0, None
    for name, param in named:
        full = gather_full(param.detach(), param, dims).cpu() + _norm_offset(config, name)
        if not writes or error is not None:
            continue
        offset = 0
        for block in layout[name]:
            rows = block.stop - block.start
            tensors = pending[files[block.name]]
            if block.name not in tensors:
                tensors[block.name] = torch.empty(shapes[block.name], dtype=dtype)
            tensors[block.name][block.start:block.stop] = full[offset:offset + rows]
            offset += rows
        try:
            os.makedirs(out_dir, exist_ok=True)
            for file_name in {files[block.name] for block in layout[name]}:
                if len(pending[file_name]) == tensors_per_file[file_name]:
                    save_file(pending.pop(file_name), os.path.join(out_dir, file_name),
                              metadata={"format": "pt"})
        except OSError as err:
            error = f"rank {dims.rank} could not write into {out_dir}: {err}"
    if dims.rank == 0 and error is None and len(tensors_per_file) > 1:
        total = sum(torch.Size(shape).numel() for shape in shapes.values()) * dtype.itemsize
        try:
            with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": files}, f, indent=2)
        except OSError as err:
            error = f"rank 0 could not write {out_dir}/{SAFETENSORS_INDEX}: {err}"
    return error


def _plan_files(config: ModelConfig, stage_orders: list[list[str]], dtype: torch.dtype,
                max_shard_bytes: int) -> dict[str, str]:
    """HF tensor name -> output file, filled in the order each stage gathers its parameters
    (so that a file completes before the next one starts) up to max_shard_bytes, a new file at
    each stage (its writer writes it alone)."""
    shapes, layout = hf_shapes(config), weight_layout(config)
    groups: list[list[str]] = []
    for order in stage_orders:
        groups.append([])
        size = 0
        for name in dict.fromkeys(block.name for ours in order for block in layout[ours]):
            nbytes = torch.Size(shapes[name]).numel() * dtype.itemsize
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
    if len(groups) == 1:
        return dict.fromkeys(groups[0], SAFETENSORS_FILE)
    count = len(groups)
    return {name: f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            for i, group in enumerate(groups) for name in group}
