"""The pipeline boundary codecs (--pipeline-codec, pipeline/codec.py, transport_codec.py,
codec_rate.py) on gloo, PP2 (2 ranks) and PP3 (3 ranks), GPT fp32, 1F1B, 4 micro-batches:

- `none` (every link's setting, through the codec transport) and adatopk at k = h (native
  values) give the loss and every gradient bit for bit of the pipeline without a codec;
- adatopk at density 1/4: the loss and every gradient equal, within 1e-5,
  autograd of one process's whole model with the same top-k mask applied to the output of each
  boundary's layer (the masked function), so the gradient at the kept indices is exact
  (1F1B and eager-1F1B each);
- bytes on the wire: each boundary's bytes sent per step equal the formulas written out here
  (4 R + R h for int8, 4 R + R h / 2 for int4, R k (4 + 2) and R k 4 for adatopk's fp32
  activation and gradient, 4 R + 3 R k and 4 R + R k with int8 values, 4 R + 2 R k + R k' / 2
  and 4 R + R k' / 2 with int4 values, k' = k + k % 2, at an even and an odd k);
- resume: int4 with error feedback, the codec's state saved after 2 steps and loaded into a
  fresh runtime gives steps 3 and 4 the uninterrupted run's losses bit for bit (and without it,
  other losses); through the training loop's checkpoints: test_pipeline_codec_checkpoint.py;
- adaptive (--pipeline-codec auto, every 2 steps): every rank holds the same decisions, taken
  at steps 2 and 4, and the step after each sends each boundary's decided setting's bytes.
Without a process group: int8 / int4, and adatopk's int8 / int4 values (odd k included, the
activation and its gradient at the kept indices), decode to the ZeRO++ torch reference's values,
within scale / 2 of the input; the rate rule's choices on hand-made link times; bad codec flags end
in one line naming the flag.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from test_tp_equivalence import batch, tiny_config

from configs import parallel_config
from dist_utils import C, DistSuite, assert_close
from megadomino.build import build_model, build_stage
from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError
from megadomino.config.pipeline_plan import uniform_plan
from megadomino.distributed import ParallelDims
from megadomino.kernels.block_dequantize import dequantize_reference
from megadomino.kernels.block_quantize import quantize_reference
from megadomino.pipeline.codec import Format, Setting, decode, encode, message_bytes, top_k
from megadomino.pipeline.codec_rate import choose
from megadomino.pipeline.runtime import PipelineRuntime
from megadomino.pipeline.stage import load_stage_full_state, stage_full_state

MBS, MICRO, LAYERS_PER_STAGE, REL = 3, 4, 2, 1e-5


def _config(pp: int):
    return tiny_config("gpt", num_layers=LAYERS_PER_STAGE * pp, vocab_size=331)


def _full_state(config, dims_ref):
    torch.manual_seed(7)
    return build_model(config, dims_ref, "gpt", device="cpu").full_state_dict()


def _run(dims, full, schedule="1f1b", steps=(0,), state=None, settings=None, **codec):
    """Build a stage and a runtime (with `codec`'s flags; `state`: the codec's state loaded,
    `settings`: every boundary's set), run forward_backward on the batches of each step in
    `steps`; (losses, the last step's gradients, the runtime). The bytes counted are the
    steps'; `runtime.loading`: whether each step ran its loading action list."""
    config = _config(dims.pp)
    plan = uniform_plan(config.num_layers, dims.world_size, 1, dims.pp)
    parallel = parallel_config(pipeline_model_parallel_size=dims.pp, **codec)
    stage = build_stage(config, dims, plan, "gpt", "cpu", parallel=parallel)
    load_stage_full_state(stage, full)
    runtime = PipelineRuntime(stage, plan, dims, config, parallel, schedule, MBS, MICRO)
    if state is not None:
        runtime.codec.load_state_dict(state)
    if settings is not None:
        runtime.codec.transport.apply(settings)
    if runtime.codec is not None:
        runtime.codec.transport.sent_bytes.clear()
    runtime.first_settings = runtime.codec.settings if runtime.codec is not None else None
    runtime.loading, actions = [], runtime.actions
    runtime.actions = lambda num, loading=False: runtime.loading.append(loading) or actions(
        num, loading)
    losses = []
    for step in steps:
        stage.zero_grad(set_to_none=True)
        batches = [batch(config, seed=100 * step + m, b=MBS)[:3] for m in range(MICRO)]
        losses.append(runtime.forward_backward(batches))
    return losses, stage_full_state(stage, grads=True), runtime


def check_bit_identical(dims, dims_ref, schedule: str, **codec):
    full = _full_state(_config(dims.pp), dims_ref)
    (plain,), plain_grads, _ = _run(dims, full, schedule)
    (loss,), grads, _ = _run(dims, full, schedule, **codec)
    assert torch.equal(loss, plain), (loss, plain)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


def _masked_reference(config, dims_ref, full, pp: int, k: int):
    """One process, the whole model, each boundary layer's output multiplied by its top-k
    mask (held constant: autograd's gradient is the masked one)."""
    model = build_model(config, dims_ref, "gpt", device="cpu")
    model.load_full_state_dict(full)

    def mask(module, inputs, out):
        rows = out.reshape(-1, out.shape[-1])
        kept = top_k(rows.detach(), k)
        return (rows * torch.zeros_like(rows).scatter_(1, kept, 1.0)).view_as(out)

    for s in range(1, pp):
        model.decoder.layers[s * LAYERS_PER_STAGE - 1].register_forward_hook(mask)
    total = torch.zeros(())
    for m in range(MICRO):
        tokens, labels, loss_mask = batch(config, seed=m, b=MBS)[:3]
        loss = model(tokens, labels=labels, loss_mask=loss_mask).sum() / loss_mask.sum()
        (loss / MICRO).backward()
        total += loss.detach()
    return total / MICRO, model.full_grad_dict()


def check_masked_gradient(dims, dims_ref, schedule: str):
    config = _config(dims.pp)
    full = _full_state(config, dims_ref)
    k = config.hidden_size // 4
    ref_loss, ref_grads = _masked_reference(config, dims_ref, full, dims.pp, k)
    (loss,), grads, _ = _run(dims, full, schedule, pipeline_codec="adatopk",
                             pipeline_codec_interval=0, pipeline_codec_density=0.25)
    assert_close(loss, ref_loss, REL, "mean loss")
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], REL, f"grad {name}")


def check_bytes(dims, dims_ref, codec: str, values: str = "native", density: float = 0.25):
    config = _config(dims.pp)
    h, rows = config.hidden_size, config.seq_length * MBS
    k = math.ceil(density * h)
    packed = rows * ((k + 1) // 2)  # int4 values: an odd k padded to even, two a byte
    expected = {"int8": (4 * rows + rows * h,) * 2,
                "int4": (4 * rows + rows * h // 2,) * 2,
                "adatopk": {"native": (rows * k * (4 + 2), rows * k * 4),
                            "int8": (4 * rows + 3 * rows * k, 4 * rows + rows * k),
                            "int4": (4 * rows + 2 * rows * k + packed, 4 * rows + packed)}[values],
                }[codec]
    _, _, runtime = _run(dims, _full_state(config, dims_ref), pipeline_codec=codec,
                         pipeline_codec_interval=0, pipeline_codec_density=density,
                         pipeline_codec_values=values)
    sent = runtime.codec.transport.sent_bytes
    stage = dims.pp_rank
    want = {}
    if stage < dims.pp - 1:
        want[("F", stage)] = MICRO * expected[0]
    if stage > 0:
        want[("B", stage - 1)] = MICRO * expected[1]
    assert sent == want, (sent, want)


def check_resume(dims, dims_ref):
    full = _full_state(_config(dims.pp), dims_ref)
    codec = dict(pipeline_codec="int4", pipeline_codec_interval=0,
                 pipeline_codec_error_feedback=True)
    whole, _, _ = _run(dims, full, steps=(0, 1, 2, 3), **codec)
    _, _, first = _run(dims, full, steps=(0, 1), **codec)
    state = first.codec.state_dict()
    assert state["transport"]["residuals"], "error feedback kept no residual"
    resumed, _, _ = _run(dims, full, steps=(2, 3), state=state, **codec)
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole[2:], strict=True))
    fresh, _, _ = _run(dims, full, steps=(2, 3), **codec)
    assert not all(torch.equal(a, b) for a, b in zip(fresh, whole[2:], strict=True))


def check_adaptive(dims, dims_ref):
    full = _full_state(_config(dims.pp), dims_ref)
    config = _config(dims.pp)
    parallel = dict(pipeline_codec="auto", pipeline_codec_interval=2)
    _, _, runtime = _run(dims, full, steps=(0, 1, 2), **parallel)
    history = runtime.codec.history
    assert [step for step, _ in history] == [2]
    # the first step and the first after a change of setting launch kernels for the first time
    changed = tuple(history[0][1]) != runtime.first_settings
    assert runtime.loading == [True, False, changed], (runtime.loading, history)
    everyone = [None] * dims.world_size
    dist.all_gather_object(everyone, history)
    assert all(h == history for h in everyone), everyone
    # the step after the decision sent each boundary's decided setting
    transport = runtime.codec.transport
    fmt = runtime.codec.fmt
    before = dict(transport.sent_bytes)
    batches = [batch(config, seed=900 + m, b=MBS)[:3] for m in range(MICRO)]
    runtime.forward_backward(batches)  # step 3: no decision
    settings = history[-1][1]
    stage = dims.pp_rank
    if stage < dims.pp - 1:
        sent = transport.sent_bytes[("F", stage)] - before[("F", stage)]
        assert sent == MICRO * message_bytes(settings[stage], fmt, "F")


SUITE = DistSuite(worlds=(2, 3))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"ref": ParallelDims(tp=1), "pp": ParallelDims(tp=1, pp=world)}


for world in (2, 3):
    for schedule in ("1f1b", "eager-1f1b"):
        SUITE.case(f"pp{world}-none-{schedule}", check_bit_identical, C.pp, C.ref, schedule,
                   worlds=(world,), pipeline_codec="int8", pipeline_codec_interval=0,
                   settings=(Setting("none"),) * world)
        SUITE.case(f"pp{world}-topk-all-{schedule}", check_bit_identical, C.pp, C.ref,
                   schedule, worlds=(world,), pipeline_codec="adatopk",
                   pipeline_codec_density=1.0, pipeline_codec_interval=0)
        SUITE.case(f"pp{world}-masked-gradient-{schedule}", check_masked_gradient, C.pp,
                   C.ref, schedule, worlds=(world,))
    SUITE.case(f"pp{world}-resume", check_resume, C.pp, C.ref, worlds=(world,))
    SUITE.case(f"pp{world}-adaptive", check_adaptive, C.pp, C.ref, worlds=(world,))
for codec, values in (("int8", "native"), ("int4", "native"), ("adatopk", "native"),
                      ("adatopk", "int8"), ("adatopk", "int4")):
    SUITE.case(f"pp3-bytes-{codec}-{values}", check_bytes, C.pp, C.ref, codec, values,
               worlds=(3,))
SUITE.case("pp3-bytes-adatopk-int4-odd-k", check_bytes, C.pp, C.ref, "adatopk", "int4", 0.22,
           worlds=(3,))  # k = 11 of 48

test_pipeline_codec = SUITE.test()


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_boundary_is_the_zeropp_reference(codec, dtype):
    torch.manual_seed(3)
    rows, h = 24, 48
    x = (torch.randn(rows, h) * torch.logspace(-3, 2, rows)[:, None]).to(dtype)
    fmt = Format(rows, h, dtype)
    wire, _ = encode(x, Setting(codec), fmt, "F")
    out = torch.empty_like(x)
    decode(wire, Setting(codec), fmt, "F", out)
    bits = 8 if codec == "int8" else 4
    q, scales = quantize_reference(x, bits, h)
    assert torch.equal(out, dequantize_reference(q, scales, x.numel(), bits, h, dtype).view_as(x))
    bound = scales[:, None] / 2 + x.abs().float() * torch.finfo(dtype).eps  # + the cast
    assert ((out.float() - x.float()).abs() <= bound).all()


@pytest.mark.parametrize("values", ["int8", "int4"])
@pytest.mark.parametrize("k", [12, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_topk_values_are_the_zeropp_reference(values, k, dtype):
    """adatopk's quantized values: the activation at its kept indices, and the gradient sent
    back at them, decode to the ZeRO++ torch reference of each row of kept values (int4: an
    odd row padded with a zero, which leaves the row's scale absmax / 7), zero elsewhere."""
    torch.manual_seed(3)
    rows, h = 24, 48
    bits, block = (8, k) if values == "int8" else (4, k + k % 2)
    x = (torch.randn(rows, h) * torch.logspace(-3, 2, rows)[:, None]).to(dtype)
    g = (torch.randn(rows, h) * torch.logspace(2, -3, rows)[:, None]).to(dtype)
    fmt, setting = Format(rows, h, dtype, values=values), Setting("adatopk", k)
    wire, sent = encode(x, setting, fmt, "F")
    assert wire.numel() == message_bytes(setting, fmt, "F") == 4 * rows + rows * (
        2 * k + block * bits // 8)
    out, grad = torch.empty_like(x), torch.empty_like(g)
    received = decode(wire, setting, fmt, "F", out)
    assert torch.equal(sent, top_k(x, k)) and torch.equal(received, sent)
    wire_b, _ = encode(g, setting, fmt, "B", received)
    assert wire_b.numel() == message_bytes(setting, fmt, "B") == 4 * rows + rows * block * bits // 8
    decode(wire_b, setting, fmt, "B", grad, sent)
    for tensor, decoded in ((x, out), (g, grad)):
        kept = tensor.gather(1, sent)
        q, scales = quantize_reference(torch.nn.functional.pad(kept, (0, block - k)), bits, block)
        assert torch.equal(scales, kept.float().abs().amax(1) / (2 ** (bits - 1) - 1))
        want = dequantize_reference(q, scales, rows * block, bits, block, dtype).view(rows, block)
        assert torch.equal(decoded, torch.zeros_like(tensor).scatter_(1, sent, want[:, :k]))
        bound = scales[:, None] / 2 + kept.abs().float() * torch.finfo(dtype).eps  # + the cast
        assert ((decoded.gather(1, sent).float() - kept.float()).abs() <= bound).all()


def test_rate_rule_finds_the_largest_k_with_int4_values():
    """int4 values cost 2.5 bytes an entry over two entries, 3 for the first of an odd pair."""
    fmt = Format(rows=100, hidden=64, dtype=torch.bfloat16, values="int4")
    link = {"F": (4, 2.0**-10), "B": (4, 2.0**-10)}  # exact per-byte times
    up = {k: 400 + 200 * k + 100 * ((k + 1) // 2) for k in (10, 11)}  # the slower direction
    assert [message_bytes(Setting("adatopk", k), fmt, "F") for k in (10, 11)] == list(up.values())
    assert choose("adatopk", fmt, 0.01, link, 4 * up[11] * 2.0**-10) == Setting("adatopk", 11)
    assert choose("adatopk", fmt, 0.01, link, 4 * (up[11] - 1) * 2.0**-10) == \
        Setting("adatopk", 10)
    assert choose("adatopk", fmt, 0.01, link, 4 * up[10] * 2.0**-10) == Setting("adatopk", 10)


def test_rate_rule_takes_the_least_compression_that_fits():
    fmt = Format(rows=100, hidden=64, dtype=torch.bfloat16)
    dense = 100 * 64 * 2
    link = {"F": (4, 1e-6), "B": (4, 1e-6)}  # 4 messages a step each way, 1 us a byte
    assert choose("auto", fmt, 0.1, link, 4 * dense * 1e-6) == Setting("none")
    assert choose("auto", fmt, 0.1, link, 4 * (400 + 6400) * 1e-6) == Setting("int8")
    assert choose("auto", fmt, 0.1, link, 4 * (400 + 3200) * 1e-6) == Setting("int4")
    budget = 4 * 100 * 8 * 4 * 1e-6  # adatopk bf16: R k 4 bytes up, R k 2 down
    assert choose("auto", fmt, 0.1, link, budget) == Setting("adatopk", 8)
    assert choose("adatopk", fmt, 0.1, link, budget * 2) == Setting("adatopk", 16)
    assert choose("adatopk", fmt, 0.5, link, 0.0) == Setting("adatopk", 32)  # the floor
    assert choose("int8", fmt, 0.1, link, 0.0) == Setting("int8")


@pytest.mark.parametrize("argv, message", [
    ((), "--pipeline-codec int8 encodes pipeline boundaries: it needs"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec", "auto",
      "--pipeline-codec-interval", "0"), "--pipeline-codec-interval=0 is invalid"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec-error-feedback"),
     "--pipeline-codec-error-feedback needs --pipeline-codec a codec"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec", "int4",
      "--pipeline-codec-density", "0.2"), "--pipeline-codec-density needs --pipeline-codec "
                                          "adatopk or auto"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec", "int8",
      "--pipeline-codec-density", "0"), "--pipeline-codec-density=0.0 is invalid"),
    (("--pipeline-plan", "auto", "--pipeline-codec", "int8"),
     "--pipeline-codec int8 runs on Megatron's pipeline"),
])
def test_bad_codec_flags_are_one_line_naming_the_flag(argv, message):
    base = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "10"]
    codec = [] if "--pipeline-codec" in argv or "--pipeline-codec-error-feedback" in argv \
        else ["--pipeline-codec", "int8"]
    with pytest.raises(ConfigError) as error:
        parse_args([*base, *codec, *argv], "gpt")
    assert str(error.value).startswith(message) and "\n" not in str(error.value), error.value


@pytest.mark.parametrize("codec", [("auto",), ("int8", "--pipeline-codec-interval", "0"),
                                   ("int4", "--pipeline-codec-error-feedback")])
def test_every_codec_may_save(codec):
    """Checkpoints hold the codecs' state (tests/test_pipeline_codec_checkpoint.py)."""
    config = parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "10",
                         "--pipeline-model-parallel-size", "2", "--pipeline-codec", *codec,
                         "--save", "/tmp"], "gpt")[0]
    assert config.parallel.pipeline_codec == codec[0]
    assert config.train.checkpoint.save == "/tmp"
