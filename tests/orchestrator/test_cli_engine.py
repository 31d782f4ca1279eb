"""`farm engine ...` through Typer's CliRunner: the commands work, print what a user needs,
and every user mistake ends in one error line and a non-zero exit code, never a traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from orchestrator.cli import app, main

runner = CliRunner()


def run_main(monkeypatch, capsys, *args):
    """Run the real entry point (which maps engine errors to exit codes)."""
    monkeypatch.setattr("sys.argv", ["farm", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return exc.value.code, out.out + out.err


@pytest.mark.gpu
def test_info_json_lists_adapter_features_and_limits():
    r = runner.invoke(app, ["engine", "info", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["device"] and data["backend"]
    assert data["limits"]["max-storage-buffer-binding-size"] > 0
    assert isinstance(data["features"], list)


@pytest.mark.gpu
def test_make_model_then_generate_writes_the_image(tmp_path):
    model = tmp_path / "tiny"
    r = runner.invoke(app, ["engine", "make-model", "--preset", "tiny", "--seed", "3", "--out", str(model)])
    assert r.exit_code == 0, r.output
    assert (model / "model_index.json").is_file()
    out = tmp_path / "img.png"
    r = runner.invoke(
        app,
        ["engine", "generate", "--model", str(model), "--prompt", "a red bicycle", "--steps", "2",
         "--scheduler", "euler", "--out", str(out), "--json"],
    )
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    img = np.asarray(Image.open(out))
    assert img.shape == (64, 64, 3) and img.std() > 0
    assert summary["steps"] == 2 and summary["timings_ms"]["total"] > 0 and summary["peak_gpu_bytes"] > 0
    # img2img from the image just written, through the plain (human) output
    r = runner.invoke(
        app,
        ["engine", "generate", "--model", str(model), "--prompt", "a blue bicycle", "--steps", "4",
         "--init-image", str(out), "--strength", "0.5", "--out", str(tmp_path / "i2i.png")],
    )
    assert r.exit_code == 0, r.output
    assert "ms/step" in r.output and (tmp_path / "i2i.png").is_file()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra,message",
    [
        (["--height", "60"], "height must be a positive multiple of 8"),
        (["--steps", "0"], "steps must be an integer >= 1"),
        (["--scheduler", "lms"], "unknown scheduler 'lms'"),
        (["--init-image", "/nonexistent.png"], "init image /nonexistent.png does not exist"),
    ],
)
def test_generate_bad_input_is_one_clear_error(monkeypatch, capsys, tiny_model_dir, tmp_path, extra, message):
    code, text = run_main(
        monkeypatch, capsys, "engine", "generate", "--model", str(tiny_model_dir), "--prompt", "x",
        "--out", str(tmp_path / "x.png"), *extra,
    )
    assert code == 3
    assert message in text and "Traceback" not in text
    assert not (tmp_path / "x.png").exists()


def test_generate_missing_model_is_one_clear_error(monkeypatch, capsys, tmp_path):
    code, text = run_main(monkeypatch, capsys, "engine", "generate", "--model", str(tmp_path / "none"), "--prompt", "x")
    assert code == 3 and "does not exist" in text and "Traceback" not in text


def test_unsupported_model_family_is_named(monkeypatch, capsys, tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "v"
    shutil.copytree(tiny_model_dir, model)
    cfg_path = model / "scheduler" / "scheduler_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["prediction_type"] = "v_prediction"
    cfg_path.write_text(json.dumps(cfg))
    code, text = run_main(monkeypatch, capsys, "engine", "generate", "--model", str(model), "--prompt", "x")
    assert code == 3 and "v-prediction" in text and "Traceback" not in text


def test_unknown_preset_is_a_usage_error(tmp_path):
    r = runner.invoke(app, ["engine", "make-model", "--preset", "sdxl", "--out", str(tmp_path / "m")])
    assert r.exit_code == 3
    assert "sdxl" in r.output


def test_no_adapter_is_one_clear_error(monkeypatch, capsys):
    import engine.device as device

    def no_adapter():
        raise device.AdapterError(f"no WebGPU adapter could be found; {device.INSTALL_HINT}")

    monkeypatch.setattr(device, "get_gpu", no_adapter)
    code, text = run_main(monkeypatch, capsys, "engine", "info")
    assert code == 4 and "mesa-vulkan-drivers" in text and "Traceback" not in text
