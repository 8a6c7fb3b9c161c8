"""flash-eval train on a tiny random Qwen2: the same data and seed for both
settings, losses step by step, the fused backward counted, JSON, table,
chart and bad input. Nothing is timed."""

import json

import pytest
from click.testing import CliRunner
from tiny_models import save_model_folder

from flash_eval.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    words = ["attention", "tiles", "softmax", "keys", "values", "queries", "online", "merge", "exact", "memory"]
    path.write_text(" ".join(words[(i * 7) % len(words)] for i in range(4000)))
    return path


def invoke(model_dir, text_file, *args):
    return CliRunner().invoke(main, ["train", "--model", str(model_dir), "--dataset", str(text_file),
                                     "--lora-layers", "2", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def report(model_dir, text_file):
    r = invoke(model_dir, text_file, "-l", "24,40", "--steps", "4", "--batch-size", "2", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_both_settings_train_on_the_same_steps(report):
    rows = {(r["length"], r["patch"]): r for r in report["results"]}
    assert list(rows) == [(24, "off"), (24, "on"), (40, "off"), (40, "on")]
    for n in (24, 40):
        off, on = rows[(n, "off")], rows[(n, "on")]
        assert len(off["losses"]) == len(on["losses"]) == 4
        # Same weights, data and seed: the losses agree step by step.
        assert on["max_loss_relative_difference"] <= 1e-4
        assert on["max_loss_relative_difference"] == max(
            abs(b - a) / abs(a) for a, b in zip(off["losses"], on["losses"]))
        assert off["losses"][0] == pytest.approx(on["losses"][0], rel=1e-5)
        # Attention went through flash_attention, its gradients through the fused backward.
        assert on["flash_calls"] > 0 and off["flash_calls"] == 0
        assert on["gradients"]["fused"] >= 4 and on["gradients"]["recomputed"] == {}
        assert on["fallbacks"] == {}
        for r in (off, on):
            assert len(r["step_seconds"]) == 4 and r["peak_memory_gb"] > 0
            assert r["tokens_per_second"] == pytest.approx(2 * n / r["median_step_seconds"])
    p = report["protocol"]
    assert (p["fine_tune"], p["steps"], p["batch_size"], p["lora"]["layers"]) == ("lora", 4, 2, 2)
    assert 0 < report["model"]["trainable"] < report["model"]["parameters"]


def test_rounds_pool_the_step_times(model_dir, text_file):
    r = invoke(model_dir, text_file, "-l", "16", "--steps", "3", "--rounds", "2", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["protocol"]["rounds"] == 2 and "2 rounds" in rep["protocol"]["timing"]
    assert [x["patch"] for x in rep["results"]] == ["off", "on"]
    for row in rep["results"]:
        assert len(row["losses"]) == 3 and len(row["round_median_step_seconds"]) == 2
        assert min(row["round_median_step_seconds"]) <= row["median_step_seconds"] <= max(
            row["round_median_step_seconds"])
        assert row["tokens_per_second"] == pytest.approx(16 / row["median_step_seconds"])
    assert rep["results"][1]["max_loss_relative_difference"] <= 1e-4


def test_full_fine_tune_trains_every_parameter(model_dir, text_file):
    r = invoke(model_dir, text_file, "-l", "16", "--steps", "2", "--fine-tune", "full", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["model"]["trainable"] == rep["model"]["parameters"]
    assert rep["protocol"]["lora"] is None
    assert rep["results"][1]["max_loss_relative_difference"] <= 1e-4


def test_table_and_chart(model_dir, text_file, tmp_path):
    png = tmp_path / "train.png"
    r = invoke(model_dir, text_file, "-l", "16", "--steps", "2", "--plot", str(png))
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "loss first -> last" in text and "fused" in text and "LoRA rank 8 on 2 blocks" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "0 is not in the range x>=1"),
        (["-l", ""], "give at least one sequence length"),
        (["-l", "0"], "lengths must be positive, got '0'"),
        (["-l", "100000", "--steps", "2"], "need 200,002"),
        (["--learning-rate", "0"], "0 is not in the range x>0"),
        (["--fine-tune", "half"], "'half' is not one of"),
        (["--rounds", "0"], "0 is not in the range x>=1"),
    ],
)
def test_bad_input(model_dir, text_file, args, message):
    r = invoke(model_dir, text_file, *args)
    assert r.exit_code != 0
    assert message in " ".join(r.output.split())


@pytest.fixture(scope="module")
def architecture_dir(model_dir, tmp_path_factory):
    """The tiny model's config and tokenizer without its weights."""
    out = tmp_path_factory.mktemp("architecture")
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def test_random_weights_of_an_architecture(architecture_dir, model_dir, text_file):
    # random:SOURCE builds SOURCE's architecture with random weights (seeded:
    # two runs start from the same loss), no weights needed.
    runs = []
    for _ in range(2):
        r = invoke(f"random:{architecture_dir}", text_file, "-l", "16", "--steps", "2", "--dtype", "bfloat16",
                   "--json")
        assert r.exit_code == 0, r.output
        runs.append(json.loads(r.output))
    rep = runs[0]
    assert "random weights (bfloat16)" in rep["model"]["name"]
    off, on = rep["results"]
    assert off["losses"] == runs[1]["results"][0]["losses"]
    assert on["max_loss_relative_difference"] <= 2e-2 and on["gradients"]["fused"] >= 2
    # Not the trained weights: another first loss than the folder's own model.
    own = json.loads(invoke(model_dir, text_file, "-l", "16", "--steps", "2", "--json").output)
    assert own["results"][0]["losses"][0] != pytest.approx(off["losses"][0], rel=1e-3)


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "has no config.json (random weights need the architecture)"),
    (lambda d: (d / "config.json").write_text("{") and d, "config.json: JSONDecodeError"),
])
def test_random_weights_bad_source(tmp_path, text_file, make, message):
    source = make(tmp_path)
    r = invoke(f"random:{source}", text_file, "-l", "16", "--steps", "1")
    assert r.exit_code != 0
    assert message in " ".join(r.output.split())


def test_the_step_compiled_as_mlx_lm_lora_compiles_it(model_dir, text_file):
    # The default compiles the step with its state, as mlx_lm.lora's trainer
    # does; --no-compile runs it eagerly. Both train to the same losses, and
    # only the eager step calls attention again at every step (2 blocks, 3
    # steps), the compiled one replaying its trace.
    reps = {}
    for flag in ("--compile", "--no-compile"):
        r = invoke(model_dir, text_file, "-l", "24", "--steps", "3", "--json", flag)
        assert r.exit_code == 0, r.output
        reps[flag] = json.loads(r.output)
    assert reps["--compile"]["protocol"]["compiled"] is True
    assert reps["--no-compile"]["protocol"]["compiled"] is False
    for compiled, eager in zip(reps["--compile"]["results"], reps["--no-compile"]["results"]):
        assert compiled["patch"] == eager["patch"]
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    eager_on, compiled_on = reps["--no-compile"]["results"][1], reps["--compile"]["results"][1]
    assert eager_on["flash_calls"] == eager_on["gradients"]["fused"] == 2 * 3
    assert 0 < compiled_on["flash_calls"] < eager_on["flash_calls"]
