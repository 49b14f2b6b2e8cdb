"""The `flashquant-hf` command (in-process and as a subprocess) on the embedded SmolLM2.

The model loads once per test session (load_smollm2 caches it per dtype; the CLI reuses that cache in-process).
"""

import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from flashquant_hf.cli import main
from flashquant_hf.models import load_smollm2

PREFIX, TOKENS = 40, 12


@pytest.fixture(scope="session")
def smollm2():
    return load_smollm2()


def _independent_window(tokenizer, prefix: int, tokens: int) -> torch.Tensor:
    """The default text's first prefix + tokens ids, built here without flashquant_hf.eval.text."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer(text, return_tensors="pt").input_ids[:, : prefix + tokens]


def _plain_teacher_forced_ppl(model, ids: torch.Tensor, prefix: int) -> float:
    """Prefill, then one token at a time through a DynamicCache; float64 NLL of each next token."""
    cache = DynamicCache(config=model.config)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    nll = []
    with torch.no_grad():
        logits = model(ids[:, :prefix], use_cache=True, **{name: cache}).logits[0, -1]
        for t in range(prefix, ids.shape[1]):
            nll.append(-torch.log_softmax(logits.double(), -1)[ids[0, t]])
            if t + 1 < ids.shape[1]:
                logits = model(ids[:, t : t + 1], use_cache=True, **{name: cache}).logits[0, -1]
    return math.exp(torch.stack(nll).mean().item())


def _one_line_error(capsys, rc: int, needle: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "error:" in err and needle in err, err
    return err


def test_ppl_end_to_end_matches_plain_loop(smollm2, tmp_path, capsys):
    model, tokenizer = smollm2
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main([
        "ppl", "--prefix", str(PREFIX), "--tokens", str(TOKENS), "--config", "tq4", "--config",
        "tq3-r0", "--no-progress", "--json", str(out_json), "--plot", str(out_png),
    ])
    stdout = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert {"model", "text", "prefix", "tokens", "results"} <= doc.keys()
    assert (doc["model"], doc["text"], doc["prefix"], doc["tokens"]) == ("smollm2", "pydoc_data.topics", PREFIX, TOKENS)
    rows = {r["name"]: r for r in doc["results"]}
    assert list(rows) == ["dynamic", "tq4", "tq3-r0"]
    for row in rows.values():
        assert {"name", "ppl", "delta_pct", "kv_bytes", "compression", "tokens_per_s"} <= row.keys()
        assert row["name"] in stdout
    expected = _plain_teacher_forced_ppl(model, _independent_window(tokenizer, PREFIX, TOKENS), PREFIX)
    assert rows["dynamic"]["ppl"] == pytest.approx(expected, rel=1e-4)
    assert rows["tq3-r0"]["compression"] > 3 and rows["tq3-r0"]["delta_pct"] != 0
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_missing_text_file(capsys, tmp_path):
    rc = main(["ppl", "--text-file", str(tmp_path / "nope.txt")])
    _one_line_error(capsys, rc, "does not exist")


def test_text_shorter_than_window(smollm2, capsys, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("Only a few words here.")
    rc = main(["ppl", "--text-file", str(path), "--prefix", "64", "--tokens", "16", "--no-progress"])
    _one_line_error(capsys, rc, "fewer than `--prefix` + `--tokens` = 64 + 16 = 80")


def test_window_longer_than_the_model_context(smollm2, capsys):
    rc = main(["ppl", "--prefix", "8000", "--tokens", "400", "--no-progress"])
    _one_line_error(capsys, rc, "`--prefix` + `--tokens` = 8400 tokens is longer than the model's context of 8192")


@pytest.mark.parametrize(
    "spec,needle", [("bits=5", "bits"), ("tq7", "unknown"), ("bits=4,wings=2", "unknown field 'wings'")]
)
def test_bad_config(capsys, spec, needle):
    rc = main(["ppl", "--config", spec])
    _one_line_error(capsys, rc, needle)


def test_invalid_environment_variable_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setenv("FLASHQUANT_BITS", "abc")  # every preset sets bits: the variable would go unused
    rc = main(["ppl", "--prefix", "8", "--tokens", "2", "--no-progress"])
    _one_line_error(capsys, rc, "environment variable `FLASHQUANT_BITS`='abc' is invalid")


@pytest.mark.slow
def test_no_progress_silences_the_model_loader(capfd):
    """The GGUF converter's and transformers' weight-loading bars, for a GGUF file loaded from its path (the
    embedded model is cached once loaded); each switch is restored afterwards."""
    from transformers.utils import logging as hf_logging

    from flashquant_hf.eval.loading import load_model
    from flashquant_hf.models import smollm2_gguf_path

    bars = ("Converting and de-quantizing GGUF tensors", "Loading weights")
    for progress in (False, True):
        load_model(str(smollm2_gguf_path()), torch.device("cpu"), torch.float32, progress=progress)
        err = capfd.readouterr().err
        assert all((bar in err) == progress for bar in bars), err[-2000:]
    assert hf_logging.is_progress_bar_enabled()


def test_bench_on_cpu_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main(["bench"])
    _one_line_error(capsys, rc, "needs a CUDA GPU")


def test_unknown_dataset_offline_subprocess(tmp_path):
    """A real process (python -m flashquant_hf.eval) with the hub offline: one line on stderr, exit 2."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "flashquant_hf.eval", "--dataset", "no-such-org/no-such-dataset-xyz"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "could not load dataset 'no-such-org/no-such-dataset-xyz'" in err


def test_help_lists_presets(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ppl", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--prefix" in out and "tq4-r0" in out and "--seeds" in out


def test_bench_forwards_options_to_run_gpu(monkeypatch):
    """With a GPU, `bench` calls run_gpu.main with its options in sys.argv, and restores sys.argv."""
    import types

    from flashquant_hf import cli

    seen = {}

    def fake_main():
        seen["argv"] = list(sys.argv[1:])
        return 3

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "_import_run_gpu", lambda: types.SimpleNamespace(main=fake_main, __file__="run_gpu.py"))
    before = list(sys.argv)
    assert main(["bench", "--only", "decode", "codec", "--skip-tests", "--out", "o"]) == 3
    assert seen["argv"] == ["--only", "decode", "codec", "--skip-tests", "--out", "o"]
    assert sys.argv == before


def test_bench_finds_the_checkout_benchmarks():
    from flashquant_hf import cli

    module = cli._import_run_gpu()
    assert callable(module.main) and module.__file__.endswith("run_gpu.py")


def test_unwritable_json_fails_before_the_model_loads(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["ppl", "--json", str(blocker / "r.json"), "--no-progress"])
    _one_line_error(capsys, rc, "cannot be written")


def test_ppl_output_explains_itself(tiny_model_dir, capsys, tmp_path):
    """The table says what each row and column is, each row's time and the run's; "at 32K" is the compression
    projected to 32768 tokens: this run's bytes plus TQ4 codes for every further token."""
    out_json = tmp_path / "r.json"
    rc = main(["ppl", "--model", str(tiny_model_dir), "--prefix", "40", "--tokens", "8", "--config", "tq4",
               "--config", "tq4-r0", "--no-progress", "--json", str(out_json)])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("name"))
    assert header.split()[-4:] == ["32K", "tokens/s", "time", "s"]
    text = " ".join(stdout.split())
    assert "rows: dynamic = transformers' DynamicCache, exact K/V (the baseline)" in text
    assert "tq4 = 4-bit keys and values, 4 exact sink tokens, the newest 128 to 191 tokens exact" in text
    assert "tq4-r0 = 4-bit keys and values, every token compressed" in text
    assert "at 32K = the same projected to 32768 tokens" in text and "dynamic holds float32: 0.50x" in text
    rows = {row["name"]: row for row in json.loads(out_json.read_text())["results"]}
    for row in rows.values():
        row_line = next(line for line in lines if line.split()[:1] == [row["name"]])
        assert row["seconds"] > 0 and row_line.split()[-1] == f"{row['seconds']:.1f}"
    wall = next(line for line in lines if line.startswith("wall time"))
    assert "model load" in wall and f"rows {sum(row['seconds'] for row in rows.values()):.1f} s" in wall
    layers, heads, dim, held = 2, 2, 16, 40 + 8 - 1
    bf16_per_token, tq4_per_token = layers * 2 * heads * dim * 2, layers * 2 * heads * (dim // 2 + 4)
    projected = rows["tq4-r0"]["kv_bytes"] + (32768 - held) * tq4_per_token
    assert rows["tq4-r0"]["compression_32k"] == pytest.approx(32768 * bf16_per_token / projected)
    assert rows["dynamic"]["compression_32k"] == pytest.approx(0.5)
    assert rows["tq4"]["compression_32k"] is None  # 47 tokens: nothing compressed yet, no per-token size (n/a)
