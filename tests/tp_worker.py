"""Run under ``torchrun --nproc_per_node 2`` by tests/test_tensor_parallel.py (gloo, CPU ranks) and by
tests/gpu/test_multi_gpu.py (``cuda`` as a fifth argument: NCCL, one GPU per rank).

Loads the saved tiny model with ``tp_plan="auto"`` (attention heads split across ranks), generates greedily with
DynamicCache and with TurboQuantCache (window longer than the sequence, and every token compressed), and rank 0
saves the sequences, the per-step logits and each rank's KV-head count to ``argv[2]``. The tests start it with
:func:`launch`.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import DynamicCache

import flashquant_hf
from flashquant_hf import TurboQuantCache
from flashquant_hf.cache import cache_kwargs


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
            ids, **cache_kwargs(model, cache), max_new_tokens=steps, do_sample=False, output_logits=True,
            return_dict_in_generate=True,
        )
        results[name] = (out.sequences.cpu(), torch.stack(out.logits, 1).cpu())
        if isinstance(cache, TurboQuantCache):
            results[name + "_kv_heads"] = cache.layers[0].num_heads
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    # A rank that exits with its process group alive can abort in the backend's threads at interpreter shutdown.
    dist.barrier()
    dist.destroy_process_group()


def torchrun() -> str | None:
    """The torchrun next to this interpreter, else the one on PATH; None when there is none."""
    return shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


def launch(runner: str, model_dir: Path, prompt: torch.Tensor, steps: int, work_dir: Path, device: str = "cpu",
           timeout: float = 300) -> dict:
    """Run this worker with ``runner`` (a torchrun) on two ranks (``device`` "cpu": gloo, one thread each;
    "cuda": NCCL, one GPU each) over the model saved in ``model_dir`` and return rank 0's results."""
    torch.save(prompt, work_dir / "prompt.pt")
    here = Path(__file__).resolve().parent
    # The ranks import the flashquant_hf this process runs (a checkout, or an installed wheel).
    package_root = Path(flashquant_hf.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(package_root)])}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    cmd = [runner, "--standalone", "--nproc_per_node", "2", str(Path(__file__).resolve()), str(model_dir),
           str(work_dir / "out.pt"), str(work_dir / "prompt.pt"), str(steps), device]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return torch.load(work_dir / "out.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:6])
