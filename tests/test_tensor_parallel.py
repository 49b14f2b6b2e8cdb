"""TurboQuantCache under transformers tensor parallelism (``tp_plan="auto"``), two gloo ranks on the CPU.

The multi-GPU run of the same check needs a machine with several GPUs; this one exercises the part
that does not: per-rank KV heads reaching the cache, and results equal to the single-process model.
"""

from __future__ import annotations


import pytest
import torch
import tp_worker
from hf_helpers import cache_kwargs, prompt_ids, tiny_model
from transformers import DynamicCache

from flashquant_hf import TurboQuantCache

STEPS = 24


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    runner = tp_worker.torchrun()
    if runner is None:
        pytest.skip("torchrun is not installed")
    tmp = tmp_path_factory.mktemp("tp")
    model = tiny_model("llama")
    model.save_pretrained(tmp / "model")
    prompt = prompt_ids(1, 20, seed=5)
    return model, prompt, tp_worker.launch(runner, tmp / "model", prompt, STEPS, tmp)


def _single(model, prompt, cache):
    out = model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=STEPS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


def test_each_rank_caches_its_own_kv_heads(tp_results):
    model, _, results = tp_results
    per_rank = model.config.num_key_value_heads // 2
    assert results["exact_window_kv_heads"] == results["compressed_kv_heads"] == per_rank


def test_tp_generation_with_exact_window_equals_dynamic_cache(tp_results):
    _, _, results = tp_results
    assert torch.equal(results["exact_window"][0], results["dynamic"][0])


def test_tp_compressed_logits_match_the_single_process_cache(tp_results):
    model, prompt, results = tp_results
    model.generation_config.eos_token_id = None
    seq, logits = _single(model, prompt, TurboQuantCache(residual_length=0, sink_tokens=0))
    tp_seq, tp_logits = results["compressed"]
    # Same rotations and codebooks on every rank: only the order of fp32 reductions differs.
    torch.testing.assert_close(tp_logits, logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tp_seq, seq)
    dyn_seq, _ = _single(model, prompt, DynamicCache())
    assert torch.equal(results["dynamic"][0], dyn_seq)
