"""Figures the docs restate come from one results file: README's GPU table shows the newest values of
benchmarks/results.json."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# README's GPU table: (metric in benchmarks/results.json, how the README shows its newest value)
README_GPU_FIGURES = (
    ("paged_decode_speedup_b8_n32k", "{:.2f}x faster"),
    ("paged_decode_ms_b8_n32k", "({:.4f} vs "),
    ("sdpa_decode_ms_b8_n32k", " vs {:.4f} ms)"),
    ("paged_decode_hbm_fraction_b8_n32k", "{:.3f} of the device copy bandwidth"),
    ("paged_decode_speedup_b1_n128k", "| {:.2f}x / "),
    ("paged_decode_speedup_b32_n8k", " / {:.2f}x |"),
    ("fused_decode_speedup_b8_n32k", "| {:.2f}x ("),
    ("fused_decode_ms_b8_n32k", "({:.4f} vs "),
    ("fused_decode_hbm_fraction_b8_n32k", "{:.2f} of copy bandwidth"),
    ("paged_decode_speedup_k3v3_b8_n32k", "| {:.2f}x ("),
    ("paged_decode_speedup_k3v2_b8_n32k", "), {:.2f}x ("),
    ("paged_decode_speedup_k2v2_b8_n32k", "), {:.2f}x ("),
    ("paged_decode_speedup_k4v3_b8_n32k", "), {:.2f}x ("),
    ("paged_decode_speedup_k3v3_b1_n128k", "x ({:.2f} / "),
    ("fused_decode_vs_paged_k3v3_b8_n32k", "| {:.3f}, "),
    ("fused_decode_vs_paged_k3v2_b8_n32k", ", {:.3f}, "),
    ("fused_decode_vs_paged_k2v2_b8_n32k", ", {:.3f}, "),
    ("fused_decode_vs_paged_k4v3_b8_n32k", ", {:.3f} of the paged time"),
    ("decode_host_us_per_call", "| {:.1f} us |"),
    ("decode_host_us_per_call_python_launcher", "(Python launcher: {:.1f} us)"),
    ("e2e_decode_tokens_per_s_ratio_bits3_vs_bits4", "| {:.2f}x / "),
    ("e2e_decode_tokens_per_s_ratio_bits2p5_vs_bits4", " / {:.2f}x |"),
    ("e2e_decode_tokens_per_s_ratio_32k", "| {:.2f}x on the "),
    ("e2e_turboquant_decode_tokens_per_s_32k", "TurboQuantCache {:.1f} tok/s"),
    ("e2e_dynamic_decode_tokens_per_s_32k", "DynamicCache {:.1f} tok/s"),
    ("max_context_ratio", "| {:.2f}x / "),
    ("decode_peak_extra_mem_fraction_32k", " / {:.4f} of the bf16 K/V size"),
    ("fa2_prefill_vs_sdpa", "| {:.3f} "),
    ("fused_prefill_vs_sdpa", "| {:.3f} per call"),
    ("compress_hbm_fraction", "| {:.3f} / "),
    ("decompress_hbm_fraction", " / {:.3f} |"),
)


def test_readme_gpu_table_shows_the_newest_results():
    latest = {row["name"]: row["value"] for row in json.loads((ROOT / "benchmarks" / "results.json").read_text())}
    readme = (ROOT / "README.md").read_text()
    table = readme.split("### GPU")[1].split("\n\n")[2]  # the section's text, then its table
    assert table.startswith("| metric | measured | target |"), table[:200]
    missing = [(name, template.format(latest[name])) for name, template in README_GPU_FIGURES
               if template.format(latest[name]) not in table]
    assert not missing, f"README's GPU table disagrees with benchmarks/results.json: {missing}"
