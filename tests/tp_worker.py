"""Run under ``torchrun --nproc_per_node 2`` by tests/test_tensor_parallel.py (gloo, CPU ranks) and by
tests/gpu/test_multi_gpu.py (``cuda`` as a fifth argument: NCCL, one GPU per rank).

Loads the saved tiny model with ``tp_plan="auto"`` (attention heads split across ranks), generates greedily with
DynamicCache and with TurboQuantCache (window longer than the sequence, and every token compressed), and rank 0
saves the sequences, the per-step logits and each rank's KV-head count to ``argv[2]``.
"""

import os
import sys

import torch
import torch.distributed as dist
import transformers
from transformers import DynamicCache

from flashquant_hf import TurboQuantCache


def main(model_dir: str, out_path: str, prompt_path: str, steps: int, device: str = "cpu") -> None:
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    ids = torch.load(prompt_path).to(model.device)
    results = {}
    for name, cache in (
        ("dynamic", DynamicCache()),
        ("exact_window", TurboQuantCache(residual_length=10_000)),
        ("compressed", TurboQuantCache(residual_length=0, sink_tokens=0)),
    ):
        out = model.generate(
            ids, past_key_values=cache, max_new_tokens=steps, do_sample=False, output_logits=True,
            return_dict_in_generate=True,
        )
        results[name] = (out.sequences.cpu(), torch.stack(out.logits, 1).cpu())
        if isinstance(cache, TurboQuantCache):
            results[name + "_kv_heads"] = cache.layers[0].num_heads
    if dist.get_rank() == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:6])
