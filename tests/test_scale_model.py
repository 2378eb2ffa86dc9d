"""The scale model (megadomino/pipeline/placement/scale.py) and its command
(benchmarks/scale_model.py): a tiny case equals the hand computation from config/flops.py's
counts, the layer table and bus-bandwidth curves look up, interpolate and clamp as documented on
hand-made tables, more DP at a fixed batch per GPU never shortens the step through
communication, MFU stays below 1, a bad calibration file is one error line, the committed
calibration copies its raw files, and the command runs on it. No timing assertions."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from megadomino.config import ConfigError
from megadomino.config.flops import embedding_params, layer_macs, layer_params, logits_macs
from megadomino.config.model import ModelConfig
from megadomino.pipeline.placement.scale import (
    BUS_FACTOR,
    Curve,
    LayerTimes,
    Layout,
    Rates,
    layer_shape,
    layer_work,
    predict,
)

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
    """RATE FLOP/s for every layer of gpt-tiny (one measured point: its floor is its own
    time), BUSBW for every collective and size."""
    model = ModelConfig.preset("gpt-tiny")
    layer = LayerTimes.from_rows([(model, 1, 1, layer_work(model, 1, 1) / RATE)])
    busbw = {(kind, 2): Curve(((1.0, BUSBW),)) for kind in BUS_FACTOR}
    return Rates(layer, busbw, 1e8, rest, 1e15, inter_latency=0.0)


def test_curve_is_flat_beyond_points_and_log_linear_between():
    curve = Curve(((10.0, 1.0), (1000.0, 100.0)))
    assert curve(1.0) == 1.0 and curve(1e6) == 100.0
    assert curve(100.0) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="distinct"):
        Curve(((10.0, 1.0), (10.0, 2.0)))


def tiny_table() -> tuple[ModelConfig, LayerTimes]:
    """gpt-tiny at TP shapes 1 and 4, micro-batches 1 and 4 (ms: 4, 8, 2, 3)."""
    gpt = ModelConfig.preset("gpt-tiny")
    rows = [(gpt, 1, 1, 4e-3), (gpt, 1, 4, 8e-3), (gpt, 4, 1, 2e-3), (gpt, 4, 4, 3e-3)]
    return gpt, LayerTimes.from_rows(rows)


def test_layer_times_look_up_and_interpolate():
    gpt, table = tiny_table()
    for tp, micro_batch, seconds in ((1, 1, 4e-3), (1, 4, 8e-3), (4, 1, 2e-3), (4, 4, 3e-3)):
        assert table.seconds(gpt, tp, micro_batch) == pytest.approx(seconds, rel=1e-12)
    # micro-batch 2 at TP 1: the rate halfway (log) between micro-batch 1's and 4's
    assert table.seconds(gpt, 1, 2) == pytest.approx(4e-3 * math.sqrt(2))
    # TP 2, micro-batch 1 (FLOPs W/2): TP 1's rate there is its first point's (below its
    # FLOPs), TP 4's is halfway between its two; TP 2 is halfway (log) between TP 1 and 4
    tp4_seconds = math.sqrt(8e-3 * 3e-3)  # TP 4's rate at its FLOPs W/2, as seconds of W
    assert table.seconds(gpt, 2, 1) == pytest.approx(0.5 * math.sqrt(4e-3 * tp4_seconds))


def test_layer_times_clamp_and_floor():
    gpt, table = tiny_table()
    # beyond the largest micro-batch the rate holds: the time grows with the FLOPs
    assert table.seconds(gpt, 1, 8) == pytest.approx(16e-3)
    # TP 8 uses TP 4's curve; its FLOPs are below it (1 ms at that rate): the 2 ms floor
    assert table.seconds(gpt, 8, 1) == pytest.approx(2e-3)
    # a longer sequence is the same layer with more FLOPs (its rate at them)
    longer = ModelConfig.preset("gpt-tiny", seq_length=256, max_position_embeddings=256)
    work = layer_work(longer, 1, 4)
    assert work > layer_work(gpt, 1, 4)
    assert table.seconds(longer, 1, 4) == pytest.approx(work / (layer_work(gpt, 1, 4) / 8e-3))


def test_unmeasured_layer_uses_nearest_of_its_kind():
    gpt, llama = ModelConfig.preset("gpt-tiny"), ModelConfig.preset("llama-tiny")
    table = LayerTimes.from_rows([(gpt, 1, 1, 1e-3), (llama, 1, 1, 2e-3),
                                  (ModelConfig.preset("gpt3-1.3b"), 1, 1, 3e-3)])
    assert table.measured(ModelConfig.preset("gpt-tiny", hidden_size=128)) == layer_shape(gpt)
    assert table.measured(ModelConfig.preset("llama2-70b")) == layer_shape(llama)
    assert table.measured(ModelConfig.preset("gpt3-13b")) == layer_shape(
        ModelConfig.preset("gpt3-1.3b"))


def test_busbw_by_collective_and_size():
    busbw = {("all_reduce", 2): Curve(((1e6, 1e10), (1e8, 1e11))),
             ("all_reduce", 4): Curve(((1e6, 2e10),)),
             ("reduce_scatter", 2): Curve(((1e6, 5e9),))}
    rates = Rates(flat_rates().layer, busbw, 1e9, 0.0, 1e15, inter_latency=1e-5)
    assert rates.bandwidth("all_reduce", 2, 1e7) == pytest.approx(math.sqrt(1e10 * 1e11))
    assert rates.bandwidth("all_reduce", 2, 1e3) == 1e10  # clamped below the measured sizes
    assert rates.bandwidth("all_reduce", 2, 1e12) == 1e11  # and above
    assert rates.bandwidth("all_reduce", 3, 1e7) == pytest.approx(math.sqrt(1e10 * 1e11))
    assert rates.bandwidth("all_reduce", 8, 1e7) == 2e10  # the largest measured group's
    assert rates.bandwidth("reduce_scatter", 4, 1e7) == 5e9  # each collective its own curve
    # inside a node the measured time is the whole time; across nodes latency is added
    assert rates.collective("reduce_scatter", 1e7, 4, True) == pytest.approx(0.75 * 1e7 / 5e9)
    assert rates.collective("reduce_scatter", 1e7, 4, False) == pytest.approx(
        3 * 1e-5 + 0.75 * 1e7 / 1e9)
    with pytest.raises(ValueError, match="all_gather"):
        rates.collective("all_gather", 1e7, 2, True)


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


def _negative_step(data):
    data["one_gpu"][0]["step_s"] = -1


def _twice(data):
    data["layer"].append(dict(data["layer"][0]))


def _stand_in(data):  # a busbw entry without a measured curve point
    data["busbw"][0] = {"gpus": 2, "collective": "all_reduce", "with_ms": 2.0,
                        "without_ms": 1.0, "source": data["busbw"][0]["source"]}


def _unknown_collective(data):
    data["busbw"][0]["collective"] = "all_to_all"


def _no_all_gather(data):
    data["busbw"] = [e for e in data["busbw"] if e["collective"] != "all_gather"]


def _no_source(data):
    data["layer"][0]["source"] = "benchmarks/results/missing.json"


def _orphan(data):
    data["held_out"][0]["calibration"] = "no such row"


@pytest.mark.parametrize("change, says", [
    (_negative_step, "needs positive"), (_twice, "appears twice"),
    (_stand_in, "needs positive gpus, bytes, bus_gbps"),
    (_unknown_collective, "collective missing or unknown"), (_no_all_gather, "all_gather"),
    (_no_source, "is not a file"), (_orphan, "no one_gpu row"),
])
def test_bad_entry_is_one_line_naming_the_file(tmp_path, capsys, change, says):
    data = json.loads(bench.CALIBRATION.read_text())
    change(data)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=says) as error:
        bench.load_calibration(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)
    assert bench.main(["--calibration", str(path), "--out-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_calibration_values_match_their_sources():
    """Every layer and bus-bandwidth entry is its raw file's row, and every raw row is in."""
    data = bench.load_calibration(bench.CALIBRATION)
    keys = {"layer": ("layers", ("preset", "tp_shape", "micro_batch", "seq", "ms")),
            "busbw": ("busbw", ("gpus", "collective", "bytes", "bus_gbps"))}
    for part, (raw_key, fields) in keys.items():
        sources = {entry["source"] for entry in data[part]}
        raw = [tuple(row[k] for k in fields) for source in sorted(sources)
               for row in json.loads((bench.REPO / source).read_text())[raw_key]]
        entries = [tuple(entry[k] for k in fields) for entry in data[part]]
        assert sorted(entries, key=str) == sorted(raw, key=str)
        assert not any("stand_in" in entry for entry in data[part])


def test_command_runs_on_committed_calibration(tmp_path, capsys):
    assert bench.main(["--out-dir", str(tmp_path), "--presets", "gpt3-1.3b", "gpt3-6.7b"]) == 0
    out = capsys.readouterr().out
    assert out.count("median |error|") == 2 and "4096" in out
    assert (tmp_path / "scale_model.png").stat().st_size > 0
