"""flash-eval throughput's method on a tiny random model: warm-up rounds, then
timed rounds alternating off and on; medians and per-round on/off ratios that
follow from the per-pass figures of the JSON; bad input. Nothing is timed."""

import json
import statistics

import pytest
from click.testing import CliRunner
from tiny_models import FAMILIES, save_model_folder

from flash_eval.cli import main
from flash_eval.throughput import auto_repeats, interquartile_mean, pair_ratios, rounds


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(tmp_path_factory.mktemp("tiny-model"))


def run(model_dir, *args):
    r = CliRunner().invoke(main, ["throughput", "--model", str(model_dir), "--json", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


@pytest.fixture(scope="module")
def report(model_dir):
    return run(model_dir, "-p", "16,40", "-g", "3", "--trials", "3", "--warmup", "2")


def test_rounds_alternate_off_on_after_the_warm_up(report):
    seq = report["sequence"]
    for p in (16, 40):
        for phase in ("prompt", "generation"):
            passes = [r for r in seq if r["prompt_tokens"] == p and r["phase"] == phase]
            assert [r["patch"] for r in passes] == ["off", "on"] * 5
            assert [r["warmup"] for r in passes] == [True] * 4 + [False] * 6
            assert [r["round"] for r in passes] == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2]
    # per prompt length, the prompt phase runs before the generation phase
    assert [(r["prompt_tokens"], r["phase"]) for r in seq[::10]] == [
        (16, "prompt"), (16, "generation"), (40, "prompt"), (40, "generation")]
    assert report["method"]["warmup_rounds"] == 2 and report["method"]["trials"] == 3


def test_medians_and_ratios_follow_from_the_passes(report):
    seq = [r for r in report["sequence"] if not r["warmup"]]
    rows = {(r["prompt_tokens"], r["patch"]): r for r in report["results"]}
    assert list(rows) == [(16, "off"), (16, "on"), (40, "off"), (40, "on")]
    for p in (16, 40):
        for key, phase in (("prompt_tps", "prompt"), ("generation_tps", "generation")):
            off = [r[key] for r in seq if (r["prompt_tokens"], r["phase"], r["patch"]) == (p, phase, "off")]
            on = [r[key] for r in seq if (r["prompt_tokens"], r["phase"], r["patch"]) == (p, phase, "on")]
            assert len(off) == len(on) == 3
            assert rows[(p, "off")][key] == pytest.approx(statistics.median(off))
            assert rows[(p, "on")][key] == pytest.approx(statistics.median(on))
            ratios = [b / a for a, b in zip(off, on)]  # round i of each setting, run back to back
            assert rows[(p, "on")]["pair_ratios"][key] == pytest.approx(ratios)
            assert rows[(p, "on")]["ratio_vs_off"][key] == pytest.approx(statistics.median(ratios))
            assert rows[(p, "on")]["ratio_range"][key] == pytest.approx([min(ratios), max(ratios)])
        prompt = [r for r in seq if (r["prompt_tokens"], r["phase"]) == (p, "prompt")]
        assert all(r["prompt_tps"] == pytest.approx(p / r["prompt_seconds"]) for r in prompt)
        assert all(r["peak_memory"] > 0 for r in seq)
        assert rows[(p, "on")]["flash_calls"] > 0 and rows[(p, "off")]["flash_calls"] == 0
        assert [t["round"] for t in rows[(p, "on")]["trials"]] == [0, 1, 2]


def test_pair_ratios_pairs_round_by_round():
    # a drift that hits both settings alike cancels in each pair
    off, on = [100.0, 200.0, 300.0], [110.0, 220.0, 330.0]
    s = pair_ratios(off, on)
    assert s["pairs"] == pytest.approx([1.1, 1.1, 1.1])
    assert (s["median"], s["min"], s["max"]) == pytest.approx((1.1, 1.1, 1.1))
    assert statistics.median(on) / statistics.median(off) == pytest.approx(1.1)
    assert list(rounds(1, 2)) == [(0, True), (0, False), (1, False)]


def test_prompt_rounds_interleave_repeated_passes(model_dir):
    layers = FAMILIES["qwen2"]["num_hidden_layers"]
    rep = run(model_dir, "-p", "16", "-g", "0", "--trials", "2", "--warmup", "1", "--prompt-repeats", "3")
    seq = rep["sequence"]
    assert [(r["patch"], r["warmup"], len(r["prompt_passes"])) for r in seq] == [
        ("off", True, 1), ("on", True, 1), ("off", False, 3), ("on", False, 3), ("off", False, 3), ("on", False, 3)]
    for r in seq:
        assert r["prompt_seconds"] == pytest.approx(interquartile_mean(r["prompt_passes"]))
        assert r["flash_calls"] == (0 if r["patch"] == "off" else len(r["prompt_passes"]) * layers)
    assert rep["method"]["prompt_repeats"] == 3


def test_prompt_repeats_auto_sized_by_the_warm_up(model_dir):
    rep = run(model_dir, "-p", "16,24", "-g", "0", "--trials", "1", "--warmup", "1")
    for p in (16, 24):
        warm = [r["prompt_seconds"] for r in rep["sequence"] if r["prompt_tokens"] == p and r["warmup"]]
        timed = [r for r in rep["sequence"] if r["prompt_tokens"] == p and not r["warmup"]]
        assert rep["method"]["prompt_repeats"][str(p)] == auto_repeats(max(warm))
        assert all(len(r["prompt_passes"]) == auto_repeats(max(warm)) for r in timed)
    # without warm-up there is nothing to size by: one pass
    rep = run(model_dir, "-p", "16", "-g", "0", "--trials", "1", "--warmup", "0")
    assert rep["method"]["prompt_repeats"] == {"16": 1}


def test_interquartile_mean_and_auto_repeats():
    assert interquartile_mean([5.0]) == 5.0
    assert interquartile_mean([1.0, 2.0, 9.0]) == 4.0  # fewer than four: the plain mean
    assert interquartile_mean([100.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -50.0]) == pytest.approx(3.5)
    # about 0.5 s of passes, never fewer than five (the interquartile mean then drops one on either side)
    assert auto_repeats(0.010) == 50 and auto_repeats(0.06) == 9
    assert auto_repeats(0.5) == 5 and auto_repeats(3.0) == 5
    assert auto_repeats(1e-6) == 64 and auto_repeats(0.0) == 64


@pytest.mark.parametrize("flag", ["--trials", "-n", "--num-trials"])
def test_trials_per_setting(model_dir, flag):
    rep = run(model_dir, "-p", "24", "-g", "2", flag, "4", "--warmup", "0")
    for row in rep["results"]:
        assert len(row["trials"]) == 4
    on = rep["results"][1]
    assert len(on["pair_ratios"]["prompt_tps"]) == len(on["pair_ratios"]["generation_tps"]) == 4
    assert not any(r["warmup"] for r in rep["sequence"]) and len(rep["sequence"]) == 2 * 2 * 4


def test_prompt_only_in_mlx_lm_prefill_steps(model_dir):
    # 48 tokens in steps of 16: three forward calls a pass, each through every layer
    rep = run(model_dir, "-p", "48", "-g", "0", "--trials", "2", "--warmup", "1", "--prefill-step-size", "16",
              "--prompt-repeats", "1")
    assert {r["phase"] for r in rep["sequence"]} == {"prompt"}
    layers = FAMILIES["qwen2"]["num_hidden_layers"]
    assert [r["flash_calls"] for r in rep["sequence"]] == [0, 3 * layers] * 3
    off, on = rep["results"]
    assert off["generation_tps"] is None and "generation_tps" not in on["ratio_vs_off"]
    assert rep["method"]["generation_tps"] is None


def test_patch_order_on_first(model_dir):
    rep = run(model_dir, "-p", "16", "-g", "0", "--trials", "2", "--warmup", "0", "--patch", "on,off")
    assert [r["patch"] for r in rep["sequence"]] == ["on", "off", "on", "off"]
    on = rep["results"][0]
    off_tps = [r["prompt_tps"] for r in rep["sequence"] if r["patch"] == "off"]
    on_tps = [r["prompt_tps"] for r in rep["sequence"] if r["patch"] == "on"]
    assert on["pair_ratios"]["prompt_tps"] == pytest.approx([b / a for a, b in zip(off_tps, on_tps)])


def test_table_names_the_method(model_dir):
    r = CliRunner().invoke(main, ["throughput", "--model", str(model_dir), "-p", "16", "-g", "2", "--trials", "2",
                                  "--warmup", "1"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "timed directly" in text and "generation_tps" in text and "per-round ratios" in text
    assert "medians of 2 trials after 1 warm-up rounds" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trials", "0"], "0 is not in the range x>=1"),
        (["--trials", "-3"], "-3 is not in the range x>=1"),
        (["-n", "0"], "0 is not in the range x>=1"),
        (["--trials", "two"], "'two' is not a valid integer"),
        (["--warmup", "-1"], "-1 is not in the range x>=0"),
        (["-g", "-1"], "-1 is not in the range x>=0"),
        (["--prompt-repeats", "0"], "'0' is neither 'auto' nor a whole number >= 1"),
        (["--prompt-repeats", "many"], "'many' is neither 'auto' nor a whole number >= 1"),
    ],
)
def test_bad_input(model_dir, args, message):
    r = CliRunner().invoke(main, ["throughput", "--model", str(model_dir), *args])
    assert r.exit_code == 2
    text = " ".join(r.output.split())
    assert message in text
    assert any(f in text for f in ("--trials", "--warmup", "--generation-tokens", "--prompt-repeats"))


def test_plot_has_a_panel_per_measured_quantity(model_dir, tmp_path):
    def png_width(path):  # the IHDR chunk's width, big-endian, after the 8-byte signature
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        return int.from_bytes(data[16:20], "big")

    with_generation, prompt_only = tmp_path / "g.png", tmp_path / "p.png"
    run(model_dir, "-p", "16", "-g", "2", "--trials", "1", "--warmup", "0", "--plot", str(with_generation))
    run(model_dir, "-p", "16", "-g", "0", "--trials", "1", "--warmup", "0", "--plot", str(prompt_only))
    # three panels (prompt, generation, memory) against two: no empty generation panel
    assert png_width(prompt_only) * 3 == png_width(with_generation) * 2
