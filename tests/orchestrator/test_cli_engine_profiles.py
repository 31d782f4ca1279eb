"""`farm engine explain | tune | bench` on the tiny model: real runs on the test adapter, kept
short (few repetitions, a small time budget)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engine.profiles import load_profile_file
from orchestrator.cli import app

runner = CliRunner()
pytestmark = pytest.mark.gpu


def test_explain_lists_every_op_with_its_variant_and_reason(tiny_model_dir):
    r = runner.invoke(app, ["engine", "explain", "--model", str(tiny_model_dir), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    ops = {row["op"] for row in data["rows"]}
    assert {"linear", "conv2d", "group_norm", "attention", "geglu"} <= ops
    assert {row["network"] for row in data["rows"]} == {"text_encoder", "unet", "vae_decoder"}
    assert all(row["why"] and row["calls"] >= 1 for row in data["rows"])
    ref = json.loads(runner.invoke(app, ["engine", "explain", "--preset", "sd14", "--profile", "reference", "--json"]).output)
    assert {row["variant"] for row in ref["rows"]} == {"reference"}
    assert any(row["shape"].get("dh") == 40 and row["shape"]["tq"] == 4096 for row in ref["rows"])


def test_explain_in_f16_storage_reads_the_rules_for_packed_halves(tmp_path):
    """--precision f16-storage explains the packed-halves kernels (it explained f32's): a rule
    that names f16s holds for the UNet's calls there and for none in fp16."""
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"schema": "devicefarm.profile/1", "name": "x",
                                "rules": [{"op": "group_norm", "variant": "split", "when": {"dtype": "f16s"}}]}))
    split = {}
    for precision in ("f16-storage", "fp16"):
        r = runner.invoke(app, ["engine", "explain", "--preset", "tiny", "--profile", str(prof), "--precision", precision,
                                "--json"])
        assert r.exit_code == 0, r.output
        data = json.loads(r.output)
        split[data["dtype"]] = {row["network"] for row in data["rows"] if row["variant"] == "split"}
    assert split["f16s"] == {"unet"} and not split.get("f16", split.get("f32"))


def test_explain_refuses_an_invalid_profile_listing_choices(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"schema": "devicefarm.profile/1", "name": "x",
                               "rules": [{"op": "attention", "variant": "turbo"}]}))
    r = runner.invoke(app, ["engine", "explain", "--preset", "tiny", "--profile", str(bad)])
    assert r.exit_code != 0
    assert "turbo" in str(r.exception) and "reference" in str(r.exception)


def test_tune_writes_a_valid_profile_for_this_gpu(tiny_model_dir, tmp_path):
    out = tmp_path / "tuned.json"
    r = runner.invoke(app, ["engine", "tune", "--model", str(tiny_model_dir), "--out", str(out),
                            "--precision", "fp32", "--repeats", "1", "--warmup", "0", "--time-budget", "20"])
    assert r.exit_code == 0, r.output
    prof = load_profile_file(out)
    m = prof.measurements
    assert m and all(x["results"] and x["chosen"] in {res["variant"] for res in x["results"]} for x in m)
    assert all(res["median_ms"] >= 0 for x in m for res in x["results"])
    import engine
    from engine.device import get_gpu

    assert prof.matches(get_gpu().caps)
    pipe = engine.load_pipeline(tiny_model_dir, profile=str(out))
    assert pipe.generate("a cat", steps=1, height=64, width=64).image.shape == (64, 64, 3)


def test_tune_part_of_a_model_into_a_profile(tiny_model_dir, tmp_path, gpu):
    """--ops, --networks and --where time a part of the model (here the convolutions to at most
    4 channels: the UNet's and the decoder's conv_out); --merge-into keeps the rest of a profile.
    In f16-storage (what Chrome runs without shader-f16) it times the packed-halves kernels a
    pipeline of that precision runs, not f32's, and its rules name their element type (the
    decoder's f32 too): merged into a profile, an f16 call on the same shape keeps the profile's
    rule. A network or condition that names nothing is refused by name, before any timing."""
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"schema": "devicefarm.profile/1", "name": "base", "rules": [
        {"op": "attention", "variant": "flash", "when": {"dh": 8}},
        {"op": "conv2d", "variant": "implicit_gemm", "when": {"cout": 32, "k": 3}},
        {"op": "conv2d", "variant": "implicit_gemm", "when": {"cout": 4}}]}))
    out = tmp_path / "part.json"
    args = ["engine", "tune", "--model", str(tiny_model_dir), "--out", str(out), "--precision", "f16-storage",
            "--repeats", "1", "--warmup", "0", "--ops", "conv2d"]
    r = runner.invoke(app, [*args, "--where", '{"cout": {"max": 4}}', "--merge-into", str(base)])
    assert r.exit_code == 0, r.output
    prof = load_profile_file(out)
    assert prof.measurements and all(m["op"] == "conv2d" and m["shape"]["cout"] <= 4 for m in prof.measurements)
    # the UNet's conv_out (4 channels) in packed halves; the force_upcast decoder's post_quant_conv
    # (4) and conv_out (3) in f32
    assert sorted((m["shape"]["cout"], m["dtype"]) for m in prof.measurements) == [(3, "f32"), (4, "f16s"), (4, "f32")]
    assert {"narrow", "reference"} <= {r["variant"] for m in prof.measurements for r in m["results"]}
    kept = [(rule.op, rule.variant) for rule in prof.rules]
    assert ("attention", "flash") in kept and ("conv2d", "implicit_gemm") in kept  # the base's, not re-tuned
    unet_out = next(m for m in prof.measurements if m["dtype"] == "f16s")
    chosen = unet_out["chosen"]
    selection = prof.selection(gpu.caps)
    assert selection.choose("conv2d", unet_out["shape"], "f16s")[0].name == chosen
    assert selection.choose("conv2d", unet_out["shape"], "f16")[0].name == "implicit_gemm"
    for bad, said in ((["--networks", "unet,vae"], "no network vae"), (["--where", '{"tq": 4}'], "not a shape field"),
                      (["--where", "{cout"], "not JSON")):
        r = runner.invoke(app, [*args, *bad])
        assert r.exit_code != 0 and said in r.output + str(r.exception), r.output


def test_interrupted_tune_leaves_no_profile(tiny_model_dir, tmp_path, gpu):
    from engine.models.config import load_model_config
    from engine.tune import tune

    out = tmp_path / "tuned.json"

    def stop(i, n, what):
        if i == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune(load_model_config(tiny_model_dir), gpu, "f32", 64, 64, out, warmup=0, repeats=1, progress=stop)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_bench_ablation_prints_the_table_and_writes_json(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    r = runner.invoke(app, ["engine", "bench", "--model", str(tiny_model_dir), "--reps", "1", "--warmup", "0",
                            "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    names = [row["name"] for row in data["rows"]]
    assert names[0] == "reference" and any("Winograd" in n for n in names)
    assert all(row["unet_step_ms"]["median"] > 0 and row["peak_gpu_bytes"] > 0 for row in data["rows"])
    assert all(row["vae_decode_ms"]["median"] > 0 for row in data["rows"])
    assert "reference" in r.output and "VAE" in r.output
    # the roofline of the last row: the adapter's own peaks, and every variant op of the step
    roof = data["rows"][-1]["roofline"]
    assert roof["peaks"]["f32_tflops"] > 0 and roof["peaks"]["gbps"] > 0
    families = {row["family"]: row for row in roof["rows"]}
    assert {"linear", "conv2d", "attention", "group_norm"} <= set(families)
    assert families["linear"]["gflop"] > 0 and families["linear"]["tflops"] > 0
    assert 0 < families["conv2d"]["simt_fraction"]
    assert "roofline" in r.output and "SIMT" in r.output


def test_tune_warns_when_the_gpu_timer_is_quantized(tiny_model_dir, tmp_path, monkeypatch):
    """`farm engine tune` says so plainly when every GPU time came in one coarse step (Dawn's
    65.536 us by default), and still writes the profile."""
    import engine.tune as tuning

    ticks = iter(range(1, 10_000))

    def quantized(rt, fn, warmup, repeats):
        fn()
        return [next(ticks) * 0.065536 for _ in range(repeats)]

    monkeypatch.setattr(tuning, "time_gpu_work", quantized)
    out = tmp_path / "q.json"
    r = runner.invoke(app, ["engine", "tune", "--model", str(tiny_model_dir), "--out", str(out), "--precision", "fp32",
                            "--ops", "layer_norm", "--repeats", "2", "--warmup", "0"])
    assert r.exit_code == 0, r.output
    assert "warning: this GPU's timestamps came in steps of 65.536 us" in r.output
    assert "steps of 65.536 us" in load_profile_file(out).description
