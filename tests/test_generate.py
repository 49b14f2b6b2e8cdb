"""generate() with TurboQuantCache: identical to DynamicCache while nothing is compressed (every decoding mode),
and with compression active (every token compressed, windows shorter than the chunks) working and close to an
uncached forward of what it generated."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from hf_helpers import PAD, cache_kwargs, one_thread, prompt_ids, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from flashquant_hf import TurboQuantCache, TurboQuantConfig, TurboQuantLayer
from flashquant_hf.codebook import lloyd_max_codebook

NEW = 10
LONG_WINDOW = 1024  # longer than prompt + generated tokens: nothing is ever compressed


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _generate(model, cache, input_ids, seed: int | None = None, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        return model.generate(input_ids, max_new_tokens=NEW, **cache_kwargs(model, cache), **kwargs)


def _generated_logits(model, cache, input_ids, seed: int | None = None, **kwargs):
    """generate() -> (sequences, the logits each sequence's new tokens were chosen from [rows, NEW, vocab])."""
    out = _generate(model, cache, input_ids, seed, output_logits=True, output_scores=True,
                    return_dict_in_generate=True, **kwargs)
    logits = torch.stack(out.logits, 1)
    if getattr(out, "beam_indices", None) is not None:  # the beam each returned sequence took at each step
        logits = logits[out.beam_indices[:, :NEW], torch.arange(NEW)]
    return out.sequences, logits


def _padded_batch():
    """Three prompts of lengths 9, 5, 7, left-padded with PAD."""
    lengths = [9, 5, 7]
    ids = torch.full((3, 9), PAD, dtype=torch.long)
    mask = torch.zeros((3, 9), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, 9 - n :] = prompt_ids(1, n, seed=row)
        mask[row, 9 - n :] = 1
    return ids, mask


MODES = {
    "greedy": dict(do_sample=False),
    "beam": dict(do_sample=False, num_beams=3),
    "sampling": dict(do_sample=True, top_k=0, temperature=1.3, num_return_sequences=2),
}


@pytest.mark.parametrize("family", ["llama", "llama_eager"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_identical_to_dynamic_cache_while_nothing_is_compressed(family, mode):
    model = tiny_model(family)
    ids = prompt_ids(2, 8, seed=1)
    expected = _generate(model, DynamicCache(), ids, seed=123, **MODES[mode])
    got = _generate(model, TurboQuantCache(residual_length=LONG_WINDOW), ids, seed=123, **MODES[mode])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["llama", "llama_eager"])
def test_identical_to_dynamic_cache_on_a_left_padded_batch(family):
    model = tiny_model(family)
    ids, mask = _padded_batch()
    expected = _generate(model, DynamicCache(), ids, attention_mask=mask, do_sample=False)
    got = _generate(model, TurboQuantCache(residual_length=LONG_WINDOW), ids, attention_mask=mask, do_sample=False)
    assert torch.equal(got, expected)


def test_identical_to_dynamic_cache_with_an_assistant_model():
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=1, num_hidden_layers=1)
    ids = prompt_ids(1, 8, seed=2)
    expected = _generate(model, DynamicCache(), ids, assistant_model=assistant, do_sample=False)
    plain = _generate(model, DynamicCache(), ids, do_sample=False)
    cache = TurboQuantCache(residual_length=LONG_WINDOW)
    got = _generate(model, cache, ids, assistant_model=assistant, do_sample=False)
    assert torch.equal(got, expected) and torch.equal(got, plain)


def test_identical_to_dynamic_cache_over_two_turns():
    model = tiny_model("llama")
    ids = prompt_ids(1, 6, seed=3)
    outputs = []
    for cache in (DynamicCache(), TurboQuantCache(residual_length=LONG_WINDOW)):
        first = _generate(model, cache, ids, do_sample=False)
        follow_up = torch.cat([first, prompt_ids(1, 4, seed=4)], dim=1)
        outputs.append(_generate(model, cache, follow_up, do_sample=False))
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("residual", [0, 3])
def test_generate_runs_with_compression_active(mode, residual):
    """Beam reordering, sample expansion and decode through the compressed path; results stay close to exact: the
    logits each new token was chosen from are within the codes' per-vector relative error (sqrt of the codebook's
    MSE on unit vectors, 9 % for 4 bits at head_dim 16) of an uncached forward of the generated sequence, as
    attention averages compressed values and the residual stream adds exact ones (measured: at most 2.6-5.4 % over
    three model seeds and every mode)."""
    model = tiny_model("llama")
    ids = prompt_ids(2, 8, seed=5)
    cache = TurboQuantCache(residual_length=residual, window_block=1)
    got, logits = _generated_logits(model, cache, ids, seed=7, **MODES[mode])
    rows = 2 * MODES[mode].get("num_return_sequences", 1)
    assert got.shape == (rows, 8 + NEW)
    with torch.inference_mode():
        exact = model(got, use_cache=False).logits[:, 8 - 1 : -1]
    error = ((logits - exact).norm(dim=-1) / exact.norm(dim=-1)).max().item()
    assert error < lloyd_max_codebook(model.config.head_dim, 4).mse_unit_vector ** 0.5, error
    layer = cache.layers[0]
    assert layer.num_sink == TurboQuantConfig().sink_tokens  # the default keeps the first tokens exact
    assert layer.num_compressed == 8 + NEW - 1 - residual - layer.num_sink
    assert layer.batch_size == rows * MODES[mode].get("num_beams", 1)


@pytest.mark.parametrize(
    "levers",
    [dict(bits=3, outlier_channels=4), dict(bits=4, key_qjl=True), dict(key_bits=4, value_bits=2, outlier_channels=8,
                                                                        key_qjl=True)],
)
def test_beam_search_runs_over_split_codes(levers):
    """Outlier channels and the QJL key residual through generate(): beam reordering moves their channel orders."""
    model = tiny_model("llama")
    ids = prompt_ids(2, 8, seed=5)
    cache = TurboQuantCache(residual_length=2, window_block=1, **levers)
    got = _generate(model, cache, ids, **MODES["beam"])
    assert got.shape == (2, 8 + NEW)
    layer = cache.layers[0]
    assert not layer.is_plain and layer.num_compressed == 8 + NEW - 1 - 2 - layer.num_sink
    if "outlier_channels" in levers:
        assert layer.key_order.shape == (6, 2, 16)  # 2 prompts x 3 beams, 2 KV heads, head_dim 16


def test_assisted_generation_with_compression_active_crops_the_store():
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=1, num_hidden_layers=1)
    ids = prompt_ids(1, 8, seed=6)
    cache = TurboQuantCache(residual_length=2, window_block=1)
    got = _generate(model, cache, ids, assistant_model=assistant, do_sample=False)
    assert got.shape == (1, 8 + NEW)
    assert cache.get_seq_length() == 8 + NEW - 1


@pytest.mark.parametrize("family", ["mistral_sliding", "gemma3"])
@pytest.mark.parametrize("model_config", [False, True])
def test_assisted_generation_after_the_sliding_window_filled(family, model_config):
    """Rejected draft tokens are rolled back with crop(), which a sliding layer past its window can do only if it
    recorded its past: generate calls activate_past_recording before the lazily built layers exist, so the cache
    passes it on to the layers it builds later. Nothing compressed: identical to DynamicCache."""
    model = tiny_model(family)
    assistant = tiny_model("llama", seed=1, num_hidden_layers=1)
    ids = prompt_ids(1, 12, seed=11)  # longer than the sliding window (8)
    expected = _generate(model, DynamicCache(), ids, assistant_model=assistant, do_sample=False)
    built = {"model_config": model.config} if model_config else {}
    cache = TurboQuantCache(residual_length=LONG_WINDOW, **built)
    got = _generate(model, cache, ids, assistant_model=assistant, do_sample=False)
    assert torch.equal(got, expected)
    assert any(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)


def test_assisted_generation_after_the_sliding_window_filled_with_compression_active():
    model = tiny_model("gemma3")  # sliding and full-attention layers
    assistant = tiny_model("llama", seed=1, num_hidden_layers=1)
    ids = prompt_ids(1, 12, seed=11)
    cache = TurboQuantCache(residual_length=2, window_block=1)
    got = _generate(model, cache, ids, assistant_model=assistant, do_sample=False)
    assert got.shape == (1, 12 + NEW)
    full = cache.layers[1]
    assert isinstance(full, TurboQuantLayer) and full.get_seq_length() == 12 + NEW - 1 and full.num_compressed > 0


@pytest.mark.parametrize("tokens", [5, 0, -3])
def test_crop_follows_dynamic_cache_on_the_installed_transformers(tokens):
    """crop() takes what DynamicCache.crop takes on the installed transformers (5.17: a positive value is the
    length to keep, deprecated; later versions raise for it); the following tokens then get DynamicCache's logits."""
    model = tiny_model("llama")
    ids = prompt_ids(1, 11, seed=12)
    outcomes = []
    for cache in (DynamicCache(), TurboQuantCache(residual_length=LONG_WINDOW)):
        with torch.no_grad():
            model(ids[:, :9], **cache_kwargs(model, cache), use_cache=True)
            try:
                cache.crop(tokens)
            except ValueError:
                outcomes.append(None)
                continue
            kept = cache.get_seq_length()
            logits = model(ids[:, kept : kept + 2], **cache_kwargs(model, cache), use_cache=True).logits
        outcomes.append((kept, logits))
    expected, got = outcomes
    if expected is None:
        assert got is None and tokens > 0
    else:
        assert got is not None and got[0] == expected[0] == min(9, 9 + tokens if tokens <= 0 else tokens)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-6)


def test_cache_and_past_key_values_keywords_generate_alike_and_ours_warns_nothing(caplog):
    """Both keywords work; the one the project passes (cache_kwargs) raises no deprecation warning."""
    model = tiny_model("llama")
    ids = prompt_ids(1, 8, seed=13)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # how transformers >= 5.2x flags `past_key_values`
        with caplog.at_level("WARNING"):
            ours = _generate(model, TurboQuantCache(residual_length=0), ids, do_sample=False)
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text
    for name in ("cache", "past_key_values"):
        if name == "cache" and "cache" not in inspect.signature(model.forward).parameters:
            continue  # transformers 5.17 knows only past_key_values
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' own notice for past_key_values
            with torch.inference_mode():
                cache = TurboQuantCache(residual_length=0)
                got = model.generate(ids, max_new_tokens=NEW, do_sample=False, **{name: cache})
        assert torch.equal(got, ours), name


def test_left_padded_rows_match_their_unpadded_runs_with_compression_active():
    """Padding reaches the compressed part as a key bias: each row decodes as if it were alone.

    No sink tokens here: sinks are the first positions of the batch, which are padding in a left-padded row, so
    such a row's own first tokens are compressed and it would not decode exactly as it does alone.
    """
    model = tiny_model("llama")
    ids, mask = _padded_batch()
    every_token = dict(residual_length=0, sink_tokens=0)
    batched = _generate(model, TurboQuantCache(**every_token), ids, attention_mask=mask, do_sample=False)
    for row in range(3):
        start = int((mask[row] == 0).sum())
        alone = _generate(model, TurboQuantCache(**every_token), ids[row : row + 1, start:], do_sample=False)
        agree = (batched[row, -NEW:] == alone[0, -NEW:]).float().mean().item()
        assert agree >= 0.8, (row, batched[row], alone[0])


def test_attn_implementation_turboquant_is_registered():
    model = tiny_model("llama")
    ids = prompt_ids(1, 8, seed=8)
    expected = _generate(model, DynamicCache(), ids, do_sample=False)
    got_exact = _generate(model, TurboQuantCache(residual_length=LONG_WINDOW), ids, do_sample=False)
    model.set_attn_implementation("turboquant")
    try:
        got = _generate(model, TurboQuantCache(residual_length=LONG_WINDOW), ids, do_sample=False)
        compressed = _generate(model, TurboQuantCache(residual_length=0), ids, do_sample=False)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(got, expected) and torch.equal(got_exact, expected)
    sdpa_compressed = _generate(model, TurboQuantCache(residual_length=0), ids, do_sample=False)
    assert torch.equal(compressed, sdpa_compressed)


def test_unrouted_attention_implementation_raises_a_clear_error():
    """An implementation flashquant does not route is left as registered; the layer whose compressed K/V reached
    it raises at its next update, so generate() fails instead of returning window-only attention."""
    from transformers.modeling_utils import AttentionInterface

    model = tiny_model("llama")
    ids = prompt_ids(1, 6, seed=9)
    cache = TurboQuantCache(residual_length=0)
    my_kernel = AttentionInterface._global_mapping["sdpa"]._flashquant_original
    AttentionInterface.register("my_kernel", my_kernel)
    TurboQuantCache()  # installing again leaves implementations it does not route alone
    assert AttentionInterface._global_mapping["my_kernel"] is my_kernel
    model.set_attn_implementation("my_kernel")
    try:
        with pytest.raises(RuntimeError, match="never reached the flashquant.*'sdpa', 'eager' or 'turboquant'"):
            _generate(model, cache, ids, do_sample=False)
    finally:
        model.set_attn_implementation("sdpa")
        AttentionInterface._global_mapping.pop("my_kernel")


@pytest.mark.slow
def test_smollm2_greedy_identical_to_dynamic_cache(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    expected = _generate(model, DynamicCache(), ids, do_sample=False)
    got = _generate(model, TurboQuantCache(residual_length=LONG_WINDOW), ids, do_sample=False)
    assert torch.equal(got, expected)


@pytest.fixture(scope="module")
def smollm2():
    from flashquant_hf.models import load_smollm2

    return load_smollm2()


def test_cache_survives_switching_between_inference_mode_no_grad_and_grad():
    model = tiny_model("llama")
    ids = prompt_ids(1, 12, seed=10)
    cache = TurboQuantCache(residual_length=2, window_block=1)
    with torch.inference_mode():
        model(ids[:, :8], **cache_kwargs(model, cache), use_cache=True)
    with torch.no_grad():
        model(ids[:, 8:9], **cache_kwargs(model, cache), use_cache=True)
    model(ids[:, 9:10], **cache_kwargs(model, cache), use_cache=True)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 10 and not layer.store.tensors[0].requires_grad
