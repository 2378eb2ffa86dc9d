"""`--enable-cuda-graph` on CPU: the capture refuses a CPU model with the flag named, and the
block's routing (graphed layers when the call matches the captured shapes in training, the eager
layers otherwise) gives the same result either way; the graphed stack is not a submodule, so
state dicts and parameter lists are unchanged. The capture itself runs in
tests/gpu/test_gpu_cuda_graph.py."""

from __future__ import annotations

import pytest
import torch

from megadomino.build import build_model
from megadomino.config import ConfigError, ModelConfig, ParallelConfig
from megadomino.distributed import ParallelDims
from megadomino.overlap.cuda_graph import GraphedLayers, GraphedRunner, _LayerStack, capture_layers

pytestmark = pytest.mark.usefixtures("single_process_group")



def _model(family: str = "llama"):
    preset = "gpt-tiny" if family == "gpt" else "llama-tiny"
    config = ModelConfig.preset(preset, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    return build_model(config, ParallelDims(tp=1), family, device="cpu",
                       parallel=ParallelConfig(enable_cuda_graph=True))


def test_capture_refuses_cpu():
    with pytest.raises(ConfigError, match="--enable-cuda-graph needs the model on a CUDA"):
        capture_layers(_model(), micro_batch_size=2)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_routing_and_state_dict(family):
    model = _model(family)
    keys = list(model.state_dict())
    params = list(model.parameters())
    tokens = torch.randint(0, 512, (2, 64))
    expected = model(tokens, labels=tokens).mean()
    calls = []

    class Counting(GraphedLayers):
        def __call__(self, *args):
            calls.append(args[0].shape)
            return super().__call__(*args)

    hidden = model.embed(tokens, None)
    rotary = model.rotary(64, None, "cpu")
    sample = (hidden, *rotary) if rotary is not None else (hidden,)
    model.decoder.runner = GraphedRunner(model.decoder,
                                         Counting(_LayerStack(model.decoder.layers), sample))
    assert list(model.state_dict()) == keys and list(model.parameters()) == params
    torch.testing.assert_close(model(tokens, labels=tokens).mean(), expected)
    assert len(calls) == 1  # training mode, matching shapes: the graphed stack ran
    model(tokens[:1], labels=tokens[:1])  # another micro-batch size: eager
    model.eval()
    with torch.no_grad():
        model(tokens, labels=tokens)  # eval: eager
    assert len(calls) == 1


def test_invalidated_graph_refuses_to_replay():
    model = _model()
    stack = _LayerStack(model.decoder.layers)
    x = torch.randn(64, 2, 64)
    rotary = model.rotary(64, None, "cpu")
    graphed = GraphedLayers(stack, (x, *rotary), still_valid=lambda: False)
    with pytest.raises(RuntimeError, match="symmetric-memory workspace .* re-allocated"):
        graphed(x, *rotary)
