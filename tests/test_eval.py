"""flashquant_hf.eval: the decode-faithful loop against independent loops, text sources, specs and reports.

Most tests use a tiny random Llama (milliseconds per step); the real SmolLM2 runs in tests/test_cli.py.
"""

import inspect
import json
import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from flashquant_hf.eval import EvalInputError, decode_perplexity, evaluate, kv_nbytes, parse_cache_spec
from flashquant_hf.eval.report import format_markdown, format_table, save_plot, write_json
from flashquant_hf.eval.specs import PRESETS, CacheSpec, parse_value
from flashquant_hf.eval.text import default_text, parse_dataset_name, read_text_file, token_window


def _tiny_llama(seed: int, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def tiny():
    return _tiny_llama(seed=0)


def _random_ids(n: int, vocab: int = 97, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _plain_loop_ppl(model, ids: torch.Tensor, prefix: int) -> float:
    """Independent oracle: DynamicCache passed along by hand, float64 cross-entropy summed by hand."""
    cache = DynamicCache(config=model.config)
    # transformers >= 5.2x calls the argument `cache`; older 5.x only knows `past_key_values`
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    total = 0.0
    with torch.no_grad():
        logits = model(ids[:, :prefix], use_cache=True, **{name: cache}).logits[0, -1]
        total += torch.nn.functional.cross_entropy(logits.double()[None], ids[0, prefix : prefix + 1]).item()
        for t in range(prefix, ids.shape[1] - 1):
            logits = model(ids[:, t : t + 1], use_cache=True, **{name: cache}).logits[0, -1]
            total += torch.nn.functional.cross_entropy(logits.double()[None], ids[0, t + 1 : t + 2]).item()
    return math.exp(total / (ids.shape[1] - prefix))


def _no_cache_ppl(model, ids: torch.Tensor, prefix: int) -> float:
    """Second oracle: one causal forward over all tokens, no cache at all (exact K/V everywhere)."""
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0].double()
    nll = torch.nn.functional.cross_entropy(logits[prefix - 1 : -1], ids[0, prefix:])
    return math.exp(nll.item())


@pytest.mark.parametrize("prefix,tokens", [(1, 2), (7, 13), (33, 40)])
def test_dynamic_ppl_matches_plain_loop_and_full_forward(tiny, prefix, tokens):
    ids = _random_ids(prefix + tokens)
    run = decode_perplexity(tiny, ids, prefix, DynamicCache(config=tiny.config))
    assert run.nll.shape == (tokens,) and run.nll.dtype == torch.float64
    assert run.ppl == pytest.approx(_plain_loop_ppl(tiny, ids, prefix), rel=1e-4)
    assert run.ppl == pytest.approx(_no_cache_ppl(tiny, ids, prefix), rel=1e-4)


class _RecordingCache(DynamicCache):
    """DynamicCache that records (layer, new tokens, cached length after update) for every update."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.calls.append((layer_idx, key_states.shape[-2], out[0].shape[-2]))
        return out


def test_loop_is_decode_faithful(tiny):
    """Prefill P, then one token per step whose K/V is in the cache (length grows by one) when it attends."""
    prefix, tokens = 5, 6
    cache = _RecordingCache(config=tiny.config)
    decode_perplexity(tiny, _random_ids(prefix + tokens), prefix, cache)
    layers = tiny.config.num_hidden_layers
    expected = [(layer, prefix, prefix) for layer in range(layers)]
    for step in range(tokens - 1):
        expected += [(layer, 1, prefix + step + 1) for layer in range(layers)]
    assert cache.calls == expected


def test_first_token_scored_from_prefill(tiny):
    """Changing only the first scored token changes only the first NLL (it is predicted by the prefill)."""
    prefix = 9
    ids = _random_ids(prefix + 4)
    other = ids.clone()
    other[0, prefix] = (ids[0, prefix] + 1) % 97
    a = decode_perplexity(tiny, ids, prefix, DynamicCache(config=tiny.config)).nll
    b = decode_perplexity(tiny, other, prefix, DynamicCache(config=tiny.config)).nll
    assert a[0] != b[0]
    # token P also enters the cache for step 1, so later NLLs may move; only the first is a pure prefill score
    logits = tiny(ids[:, :prefix]).logits[0, -1].double()
    assert a[0].item() == pytest.approx(-torch.log_softmax(logits, -1)[ids[0, prefix]].item(), rel=1e-6)


@pytest.mark.parametrize("bad", [0, 11, 12])
def test_prefix_out_of_range(tiny, bad):
    with pytest.raises(ValueError, match="prefix"):
        decode_perplexity(tiny, _random_ids(12), bad, DynamicCache(config=tiny.config))


def test_kv_bytes_and_compression_of_dynamic_rows():
    """fp32 K/V is 2x its bf16 size (compression 0.5); a bf16 model's DynamicCache is exactly 1.0x."""
    prefix, tokens = 6, 5
    for dtype, ratio, elem in [(torch.float32, 0.5, 4), (torch.bfloat16, 1.0, 2)]:
        model = _tiny_llama(seed=1, dtype=dtype)
        ids = _random_ids(prefix + tokens)
        rows = evaluate(model, ids, prefix, specs=[], progress=False)
        assert [r["name"] for r in rows] == ["dynamic"]
        c = model.config
        elements = 2 * c.num_hidden_layers * c.num_key_value_heads * (prefix + tokens - 1) * c.head_dim
        assert rows[0]["kv_bytes"] == elements * elem
        assert rows[0]["compression"] == ratio and rows[0]["delta_pct"] == 0.0
        cache = DynamicCache(config=model.config)
        decode_perplexity(model, ids, prefix, cache)
        assert kv_nbytes(cache) == elements * elem


# --- text sources --------------------------------------------------------------------------------------------


def test_default_text_is_sorted_pydoc_topics():
    from pydoc_data.topics import topics

    text = default_text()
    keys = sorted(topics)
    assert text.startswith(topics[keys[0]]) and text.endswith(topics[keys[-1]])
    assert len(text) == sum(len(v) for v in topics.values()) + 2 * (len(keys) - 1)


class _CharTokenizer:
    """One token per character (ord), enough to test the window logic without a model."""

    def __call__(self, text, return_tensors=None):
        class Out:
            input_ids = torch.tensor([[ord(ch) for ch in text]])

        return Out()


def test_token_window_and_too_short_text():
    ids = token_window(_CharTokenizer(), "abcdefghij", prefix=4, tokens=3)
    assert ids.tolist() == [[ord(c) for c in "abcdefg"]] and ids.dtype == torch.long
    long_text = "x" * 100_000 + "END"
    assert token_window(_CharTokenizer(), long_text, 10, 5).shape == (1, 15)
    with pytest.raises(EvalInputError, match=r"10 tokens, fewer than `--prefix` \+ `--tokens` = 8 \+ 3 = 11"):
        token_window(_CharTokenizer(), "abcdefghij", prefix=8, tokens=3)


def test_read_text_file_errors(tmp_path):
    with pytest.raises(EvalInputError, match="does not exist"):
        read_text_file(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(EvalInputError, match="is empty"):
        read_text_file(tmp_path / "empty.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x80abc")
    with pytest.raises(EvalInputError, match="UTF-8"):
        read_text_file(tmp_path / "bin.txt")
    (tmp_path / "ok.txt").write_text("héllo")
    assert read_text_file(tmp_path / "ok.txt") == "héllo"


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("wikitext-2", ("wikitext", "wikitext-2-raw-v1")),
        ("wikitext:wikitext-103-raw-v1", ("wikitext", "wikitext-103-raw-v1")),
        ("user/corpus", ("user/corpus", None)),
    ],
)
def test_parse_dataset_name(spec, expected):
    assert parse_dataset_name(spec) == expected


# --- cache specs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,value",
    [("4", 4), ("-1", -1), ("0.5", 0.5), ("true", True), ("False", False), ("none", None), ("haar", "haar")],
)
def test_parse_value(text, value):
    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def test_presets_and_overrides():
    assert parse_cache_spec("tq4") == CacheSpec("tq4", PRESETS["tq4"])
    spec = parse_cache_spec("tq3, residual_length=0")
    assert spec.name == "tq3, residual_length=0" and spec.overrides == {"bits": 3, "residual_length": 0}
    spec = parse_cache_spec("bits=4,residual_length=0,name=plain")
    assert spec.name == "plain" and spec.overrides == {"bits": 4, "residual_length": 0}
    assert parse_cache_spec("tq4,bits=3").overrides == {"bits": 3}  # later items win


@pytest.mark.parametrize(
    "text,match",
    [
        ("bits=5", "bits"),
        ("tq9", "preset 'tq9' is unknown"),
        ("bits=4,colour=3", "unknown field 'colour'"),
        ("bits=4,tq3", "not key=value"),
        ("tq4,,bits=3", "empty item"),
        ("dynamic", "always evaluated"),
        ("tq4,name=dynamic", "reserved"),
        ("", "preset or key=value"),
    ],
)
def test_bad_specs(text, match):
    with pytest.raises(EvalInputError, match=match):
        parse_cache_spec(text)


# --- TurboQuant rows -----------------------------------------------------------------------------------------


def test_turboquant_rows_on_tiny_model(tiny):
    """Compressed rows: same tokens, finite perplexity, bytes and compression consistent, seeds averaged.

    (At 31 tokens the compressed store's allocation granularity dominates its bytes, so no ratio > 1 here;
    tests/test_cli.py checks the ratio on SmolLM2.)
    """
    prefix, tokens = 24, 8
    ids = _random_ids(prefix + tokens)
    specs = [parse_cache_spec("tq4-r0"), parse_cache_spec("tq2-r0")]
    rows = evaluate(tiny, ids, prefix, specs, seeds=[3, 4], progress=False)
    assert [r["name"] for r in rows] == ["dynamic", "tq4-r0", "tq2-r0"]
    assert rows[0]["ppl"] == pytest.approx(_plain_loop_ppl(tiny, ids, prefix), rel=1e-4)
    for row in rows[1:]:
        assert math.isfinite(row["ppl"]) and row["ppl"] > 1
        assert row["compression"] == pytest.approx(rows[0]["bf16_kv_bytes"] / row["kv_bytes"])
        assert row["seeds"] == [3, 4] and len(row["ppl_per_seed"]) == 2
        assert row["ppl"] == pytest.approx(sum(row["ppl_per_seed"]) / 2)
        assert row["delta_pct"] == pytest.approx(100 * (row["ppl"] / rows[0]["ppl"] - 1))
        assert row["config"]["residual_length"] == 0
    # 2 bits hold fewer bytes than 4 bits
    assert rows[2]["kv_bytes"] < rows[1]["kv_bytes"]


# --- reports -------------------------------------------------------------------------------------------------


def _rows():
    return [
        {"name": "dynamic", "ppl": 10.0, "ppl_std": 0.0, "ppl_per_seed": [10.0], "delta_pct": 0.0,
         "kv_bytes": 4096, "compression": 0.5, "tokens_per_s": 11.0},
        {"name": "tq4", "ppl": 10.5, "ppl_std": 0.25, "ppl_per_seed": [10.25, 10.75], "delta_pct": 5.0,
         "kv_bytes": 512, "compression": 4.0, "tokens_per_s": float("nan")},
    ]


def test_table_json_and_plot(tmp_path):
    table = format_table(_rows())
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].split()[0] == "name"
    assert "10.5000 ± 0.2500" in lines[3] and "+5.00%" in lines[3] and "4.00x" in lines[3]
    assert "| tq4 | 10.5000 ± 0.2500 | +5.00% | 512 B | 4.00x | n/a | nan | n/a |" in format_markdown(_rows())
    path = write_json(tmp_path / "sub" / "r.json", {"model": "m", "results": _rows()})
    doc = json.loads(path.read_text())  # strict JSON: NaN became null
    assert doc["results"][1]["tokens_per_s"] is None and doc["results"][0]["name"] == "dynamic"
    png = save_plot(tmp_path / "p.png", _rows(), "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unwritable_json_path(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(EvalInputError, match="could not be written"):
        write_json(tmp_path / "file" / "r.json", {"results": []})
