"""`flashquant-hf niah`: the pass-key prompt, the two-chunk protocol, scoring, the command and its JSON.

The prompt tests use the embedded SmolLM2's tokenizer; the protocol tests a tiny random Llama; one command run
retrieves on SmolLM2 with 320-token prompts.
"""

import inspect
import json
import random

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from flashquant_hf import TurboQuantCache
from flashquant_hf.cli import main
from flashquant_hf.eval import EvalInputError
from flashquant_hf.eval.heatmap import format_accuracy, save_heatmaps
from flashquant_hf.eval.needle import (
    ANSWER_PREFIX, ANSWER_TOKENS, FILLER, INSTRUCTION, KEY_DIGITS, NEEDLE, QUESTION, build_prompt, is_correct,
    pass_key, prompt_parts,
)
from flashquant_hf.eval.retrieval import merge_runs, prefill_states, replay
from flashquant_hf.models import load_smollm2


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2()


@pytest.fixture(scope="module")
def parts(smollm2):
    return prompt_parts(smollm2[1])


@pytest.mark.parametrize("length", [256, 1000, 8192])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.37, 0.5, 1.0])
def test_needle_at_requested_depth_within_budget(smollm2, parts, length, depth):
    tokenizer = smollm2[1]
    prompt = build_prompt(tokenizer, parts, length, depth, "68421")
    unit = len(parts.unit)
    filler = prompt.haystack_end - prompt.haystack_start - (prompt.needle_end - prompt.needle_start)
    assert abs(prompt.depth - depth) <= unit / filler / 2 + 1e-9
    # the needle's tokens say the needle, and the filler on both sides is whole units
    needle_text = tokenizer.decode(prompt.context[prompt.needle_start : prompt.needle_end])
    assert needle_text == NEEDLE.format(key="68421")
    assert (prompt.needle_start - prompt.haystack_start) % unit == 0
    assert (prompt.haystack_end - prompt.needle_end) % unit == 0
    # answer included, the prompt fits the budget and wastes less than one filler unit of it
    assert length - unit < prompt.prompt_tokens + ANSWER_TOKENS <= length


def test_chunks_are_the_chat_turn(smollm2, parts):
    """Context + question = the chat template applied to instruction, haystack and question, then the answer start."""
    tokenizer = smollm2[1]
    prompt = build_prompt(tokenizer, parts, 300, 0.5, "12345")
    haystack = tokenizer.decode(prompt.context[prompt.haystack_start : prompt.haystack_end])
    assert haystack.count(FILLER) >= 5 and NEEDLE.format(key="12345") in haystack
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": INSTRUCTION + haystack + QUESTION}], tokenize=False, add_generation_prompt=True
    ) + ANSWER_PREFIX
    assert parts.chat_template
    assert tokenizer.decode(prompt.context + prompt.question) == expected
    assert tokenizer.decode(prompt.question).startswith(QUESTION)  # the question is not in the prefilled chunk
    assert QUESTION.strip() not in tokenizer.decode(prompt.context)


def test_pass_keys_are_seeded_and_distinct():
    keys = [pass_key(0, 4096, depth, i) for depth in (0.0, 0.5) for i in range(10)]
    assert keys == [pass_key(0, 4096, depth, i) for depth in (0.0, 0.5) for i in range(10)]
    assert all(len(k) == KEY_DIGITS and k.isdigit() and k[0] != "0" for k in keys)
    assert len(set(keys)) == len(keys)
    assert keys != [pass_key(1, 4096, depth, i) for depth in (0.0, 0.5) for i in range(10)]


@pytest.mark.parametrize(
    "answer,correct",
    [(" 68421.", True), ("68421", True), (" 68421 is the key", True), (" 6842.", False), (" 684210.", False),
     (" the key 68421", True), (" 12 then 68421", False), (" no number", False), ("", False)],
)
def test_exact_number_match(answer, correct):
    assert is_correct(answer, "68421") is correct


def test_too_short_length_is_refused(smollm2, parts):
    with pytest.raises(EvalInputError, match="leaves no room for filler"):
        build_prompt(smollm2[1], parts, 80, 0.5, "12345")
    with pytest.raises(EvalInputError, match="depth"):
        build_prompt(smollm2[1], parts, 400, 1.5, "12345")


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(11)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def _with_cache(model, cache) -> dict:
    # transformers >= 5.2x calls the argument `cache`; older 5.x only knows `past_key_values`
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


@torch.inference_mode()
def _question_logits(model, cache, question: torch.Tensor) -> torch.Tensor:
    return model(input_ids=question, **_with_cache(model, cache)).logits[0]


@torch.inference_mode()
def test_shared_prefix_and_replay_equal_a_one_chunk_prefill():
    """The protocol's shortcut (shared needle-free prefix, K/V handed to each cache) changes nothing.

    Reference: the context prefilled by the model as one chunk through the cache itself, then the question.
    """
    model = _tiny_llama()
    gen = torch.Generator().manual_seed(3)
    context = torch.randint(0, 97, (1, 90), generator=gen)
    question = torch.randint(0, 97, (1, 7), generator=gen)
    cut = 37
    shared = prefill_states(model, context[0, :60].tolist())  # a longer needle-free context, cut at the needle
    prefix = [(k[:, :, :cut], v[:, :, :cut]) for k, v in shared]
    states = prefill_states(model, context[0, cut:].tolist(), prefix)

    logits = {}
    for name, make in (("dynamic", lambda: DynamicCache(config=model.config)),
                       ("tq4", lambda: TurboQuantCache(bits=4, residual_length=16, model_config=model.config))):
        direct = make()
        model(input_ids=context, **_with_cache(model, direct))
        expected = _question_logits(model, direct, question)
        got = _question_logits(model, replay(make(), states), question)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        logits[name] = got
    # the question attended over compressed K/V: a different answer distribution than the exact cache's
    assert (logits["tq4"] - logits["dynamic"]).abs().max() > 1e-3


@torch.inference_mode()
def test_replay_leaves_the_states_unchanged():
    model = _tiny_llama()
    states = prefill_states(model, list(range(50)))
    before = [(k.clone(), v.clone()) for k, v in states]
    for cache in (DynamicCache(config=model.config), TurboQuantCache(residual_length=8, model_config=model.config)):
        replay(cache, states)
        model(input_ids=torch.tensor([[5, 6, 7]]), **_with_cache(model, cache))
    for (k, v), (k0, v0) in zip(states, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_niah_command_on_smollm2(smollm2, tmp_path, capsys):
    """DynamicCache retrieves every needle of a short haystack; the JSON holds every trial and the heat-map."""
    out_json, out_png = tmp_path / "n.json", tmp_path / "n.png"
    rc = main(["niah", "--lengths", "320", "--depths", "0", "1", "--config", "tq4", "--seed", "5", "--no-progress",
               "--json", str(out_json), "--plot", str(out_png)])
    stdout = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(out_json.read_text())
    expected_keys = {"model", "task", "lengths", "depths", "needles_per_cell", "seed", "wall_s", "results", "trials"}
    assert expected_keys <= doc.keys()
    assert (doc["lengths"], doc["depths"], doc["needles_per_cell"], doc["seed"]) == ([320], [0.0, 1.0], 1, 5)
    rows = {row["name"]: row for row in doc["results"]}
    assert list(rows) == ["dynamic", "tq4"]
    for row in rows.values():
        assert row["needles"] == [2] and len(row["cells"]) == 1 and len(row["cells"][0]) == 2
        assert row["accuracy"] == [row["correct"][0] / 2] and row["kv_bytes"][0] > 0
        assert row["name"] in stdout
    assert rows["dynamic"]["correct"] == [2] and rows["dynamic"]["cells"] == [[1.0, 1.0]]
    assert rows["tq4"]["config"]["bits"] == 4 and rows["tq4"]["compression"][0] > rows["dynamic"]["compression"][0]
    trials = doc["trials"]
    assert [(t["length"], t["depth"]) for t in trials] == [(320, 0.0), (320, 1.0)]
    for t in trials:
        assert t["key"] == pass_key(5, 320, t["depth"], 0)
        assert t["prompt_tokens"] + ANSWER_TOKENS <= 320 and set(t["answers"]) == {"dynamic", "tq4"}
        assert t["correct"]["dynamic"] and t["key"] in t["answers"]["dynamic"]
    assert out_png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv,needle",
    [(["--lengths", "9000"], "longer than the model's context of 8192 tokens"),
     (["--lengths", "80"], "leaves no room for filler"),
     (["--config", "bits=5"], "bits")],
)
def test_bad_input_is_one_line(smollm2, capsys, argv, needle):
    rc = main(["niah", "--no-progress", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err


def test_depth_out_of_range_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["niah", "--depths", "1.5"])
    assert exc.value.code == 2 and "expected a depth in [0, 1]" in capsys.readouterr().err


def test_heatmap_and_table_from_a_document(tmp_path):
    rng = random.Random(0)
    lengths, depths = [1024, 4096], [0.0, 0.5, 1.0]
    rows = []
    for name in ("dynamic", "tq4"):
        cells = [[rng.choice([0.0, 0.5, 1.0]) for _ in depths] for _ in lengths]
        correct = [round(sum(c) * 2) for c in cells]
        rows.append({"name": name, "cells": cells, "correct": correct, "needles": [6, 6]})
    doc = {"model": "m", "lengths": lengths, "depths": depths, "needles_per_cell": 2, "results": rows}
    table = format_accuracy(rows, lengths)
    assert table.splitlines()[0].split() == ["name", "1K", "4K", "all"]
    assert f"{rows[1]['correct'][1]}/6" in table.splitlines()[3]
    assert save_heatmaps(tmp_path / "h.png", doc).read_bytes()[:4] == b"\x89PNG"


def _document(lengths, depths, names=("dynamic", "tq4"), seed=0, needles=2):
    """A run's document: row r answers int(10 * length + 100 * depth + r) % (needles + 1) needles per cell."""
    rows = []
    for r, name in enumerate(names):
        hits = [[int(10 * n + 100 * d + r) % (needles + 1) for d in depths] for n in lengths]
        rows.append({
            "name": name, "config": None if r == 0 else {"bits": 4},
            "correct": [sum(line) for line in hits], "needles": [needles * len(depths)] * len(lengths),
            "accuracy": [sum(line) / (needles * len(depths)) for line in hits],
            "cells": [[h / needles for h in line] for line in hits],
            **{key: [f"{name}-{key}-{n}" for n in lengths] for key in ("kv_bytes", "bf16_kv_bytes", "compression")},
        })
    trials = [{"length": n, "depth": d} for n in lengths for d in depths]
    return {"model": "m", "depths": depths, "needles_per_cell": needles, "seed": seed, "lengths": lengths,
            "wall_s": 1.5, "results": rows, "trials": trials}


def test_merge_runs_joins_lengths_in_order():
    depths = [0.0, 1.0]
    merged = merge_runs([_document([8192], depths), _document([1024, 4096], depths)])
    whole = _document([1024, 4096, 8192], depths)
    assert merged["lengths"] == [1024, 4096, 8192] and merged["depths"] == depths and merged["wall_s"] == 3.0
    for row, expected in zip(merged["results"], whole["results"]):
        for key in ("correct", "needles", "accuracy", "cells", "kv_bytes", "compression"):
            assert row[key] == expected[key], key
    assert [t["length"] for t in merged["trials"]] == [1024, 1024, 4096, 4096, 8192, 8192]


def test_merge_runs_joins_depths_of_one_length():
    """Runs over disjoint depths of one length (and another length) merge to the run over all of them."""
    merged = merge_runs([_document([8192], [0.0, 0.5, 1.0]), _document([8192], [0.25, 0.75]),
                         _document([4096], [0.0, 0.25, 0.5, 0.75, 1.0])])
    whole = _document([4096, 8192], [0.0, 0.25, 0.5, 0.75, 1.0])
    assert merged["lengths"] == [4096, 8192] and merged["depths"] == whole["depths"] and merged["wall_s"] == 4.5
    for row, expected in zip(merged["results"], whole["results"]):
        assert row["config"] == expected["config"]
        for key in ("correct", "needles", "accuracy", "cells", "kv_bytes", "compression"):
            assert row[key] == expected[key], key
    assert [(t["length"], t["depth"]) for t in merged["trials"]] == [(t["length"], t["depth"]) for t in whole["trials"]]


def test_merge_runs_leaves_missing_cells_empty_and_refuses_mismatched_runs():
    merged = merge_runs([_document([8192], [0.0]), _document([4096], [1.0])])
    assert merged["depths"] == [0.0, 1.0]
    for row in merged["results"]:
        assert row["cells"][0][0] is None and row["cells"][1][1] is None
        assert row["cells"][0][1] is not None and row["cells"][1][0] is not None
    with pytest.raises(ValueError, match="seed"):
        merge_runs([_document([1024], [0.0]), _document([2048], [0.0], seed=1)])
    with pytest.raises(ValueError, match="overlap.*1024 tokens, depth 0.5"):
        merge_runs([_document([1024], [0.0, 0.5]), _document([1024], [0.5, 1.0])])
    with pytest.raises(ValueError, match="caches"):
        merge_runs([_document([1024], [0.0]), _document([2048], [0.0], names=("dynamic",))])
    with pytest.raises(ValueError, match="needles_per_cell"):
        merge_runs([_document([1024], [0.0]), _document([2048], [0.0], needles=3)])


def test_niah_merge_command_writes_the_merged_document(tmp_path, capsys):
    runs = [_document([8192], [0.0, 0.5, 1.0]), _document([8192], [0.25, 0.75])]
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    out_json, out_png = tmp_path / "merged.json", tmp_path / "merged.png"
    rc = main(["niah", "--merge", *map(str, paths), "--json", str(out_json), "--plot", str(out_png)])
    stdout = capsys.readouterr().out
    assert rc == 0 and json.loads(out_json.read_text()) == merge_runs(runs)
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    correct = merge_runs(runs)["results"][1]["correct"][0]
    assert stdout.splitlines()[-3].split()[:2] == ["tq4", f"{correct}/10"]  # the table's last row, then "wrote"
    (tmp_path / "bad.json").write_text("{")
    for argv in ([str(paths[0]), str(tmp_path / "bad.json")], [str(paths[0]), str(paths[0])]):
        rc = main(["niah", "--merge", *argv])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and "`--merge`" in err, err
