"""The scale model (megadomino/pipeline/placement/scale.py) and its command
(benchmarks/scale_model.py): a tiny case equals the hand computation from config/flops.py's
counts, more DP at a fixed batch per GPU never shortens the step through communication, MFU stays
below 1, a bad calibration file is one error line, and the command runs on the committed
calibration. No timing assertions."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from megadomino.config import ConfigError
from megadomino.config.flops import embedding_params, layer_macs, layer_params, logits_macs
from megadomino.config.model import ModelConfig
from megadomino.pipeline.placement.scale import Curve, Layout, Rates, predict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks", "scale_model.py")


def _load():
    spec = importlib.util.spec_from_file_location("scale_model", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load()
RATE, BUSBW = 1e12, 1e9


def flat_rates(rest: float = 0.0) -> Rates:
    return Rates(Curve(((1.0, RATE),)), {2: Curve(((1.0, BUSBW),))}, 1e8, rest, 1e15,
                 intra_latency=0.0, inter_latency=0.0)


def test_curve_is_flat_beyond_points_and_log_linear_between():
    curve = Curve(((10.0, 1.0), (1000.0, 100.0)))
    assert curve(1.0) == 1.0 and curve(1e6) == 100.0
    assert curve(100.0) == pytest.approx(10.0)


def test_tiny_case_equals_hand_computation():
    model = ModelConfig.preset("gpt-tiny")
    layout = Layout(tp=2, pp=1, dp=2, micro_batch=2, global_batch=8, zero_stage=0)
    seq, h, mb, tp = model.seq_length, model.hidden_size, 2, 2
    vocab = model.padded_vocab_size(tp)
    layer = 3 * 2 * seq * mb * layer_macs(model) / tp / RATE
    head = 3 * 2 * seq * mb * logits_macs(model, vocab) / tp / RATE
    tp_comm = 4 * (2 * (tp - 1) / tp) * seq * mb * h * 2 / BUSBW  # 4 all-reduces a layer
    micro = model.num_layers * (layer + tp_comm) + head  # F + B of one micro-batch
    # one stage: the layers, the embedding (word table once, positions) and the final norm
    params = model.num_layers * layer_params(model) + embedding_params(model, vocab) + h * 2
    grads = 2 * (2 - 1) / 2 * params / tp * 4 / BUSBW  # fp32 all-reduce over DP 2
    expected = 2 * micro + max(0.0, grads - 2 * micro / 3)  # overlaps the last backward
    estimate = predict(model, layout, flat_rates())
    assert estimate.step == pytest.approx(expected, rel=1e-9)
    flops = 3 * 8 * 2 * seq * (model.num_layers * layer_macs(model) + logits_macs(model, vocab))
    assert estimate.mfu == pytest.approx(flops / (expected * 4 * 1e15), rel=1e-9)


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
@pytest.mark.parametrize("calibrated", [False, True])
def test_more_dp_never_shortens_communication(zero_stage, calibrated):
    """From DP 1 at one bus bandwidth for every size; on the calibration from DP 4 on, since the
    measured 4-GPU bus bandwidth exceeds the 2-GPU one (beyond 4, the largest measured size's
    curve and then the inter-node rate hold)."""
    data = bench.load_calibration(bench.CALIBRATION)
    rates = bench.rates_for(data, 400.0, None) if calibrated else flat_rates(1e-9)
    model = ModelConfig.preset("gpt3-1.3b" if calibrated else "gpt-tiny")
    last = None
    for dp in (4, 8, 16, 64, 512, 4096) if calibrated else (1, 2, 4, 8, 16, 64):
        estimate = predict(model, Layout(1, 1, dp, 1, dp * 8, zero_stage=zero_stage), rates)
        if last is not None:
            assert estimate.dp_exposed >= last.dp_exposed
            if zero_stage == 0:  # no optimizer sharding: the whole step
                assert estimate.step >= last.step
        assert 0 < estimate.mfu <= 1
        last = estimate


def test_sweep_mfu_at_most_one():
    data = bench.load_calibration(bench.CALIBRATION)
    args = bench.parse(["--presets", "gpt3-6.7b", "--pp", "2", "--schedule", "zb-h1"])
    table = bench.sweep(data, args)
    assert all(0 < mfu <= 1 for points in table.values() for _, _, mfu, _ in points)


@pytest.mark.parametrize("text, says", [
    ("{not json", "cannot read it as JSON"),
    (json.dumps({"format": "other"}), "not a scale calibration"),
    (json.dumps({"format": bench.FORMAT, "layer": []}), "missing"),
])
def test_bad_calibration_is_one_line(tmp_path, capsys, text, says):
    path = tmp_path / "cal.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says) as error:
        bench.load_calibration(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)
    assert bench.main(["--calibration", str(path), "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_bad_entry_names_it(tmp_path):
    data = json.loads(bench.CALIBRATION.read_text())
    data["one_gpu"][0]["step_s"] = -1
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="positive times"):
        bench.load_calibration(path)


def test_calibration_values_match_their_sources():
    data = bench.load_calibration(bench.CALIBRATION)
    for entry in data["layer"]:
        raw = json.loads((bench.REPO / entry["source"]).read_text())["results"]
        rows = [r for r in raw if r["row"] == entry["preset"]]
        assert rows[0]["ms_per_layer"][entry["column"]] == entry["ms"]


def test_command_runs_on_committed_calibration(tmp_path, capsys):
    assert bench.main(["--out-dir", str(tmp_path), "--presets", "gpt3-1.3b", "gpt3-6.7b"]) == 0
    out = capsys.readouterr().out
    assert out.count("median |error|") == 2 and "4096" in out
    assert (tmp_path / "scale_model.png").stat().st_size > 0
