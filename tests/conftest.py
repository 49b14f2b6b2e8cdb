import os
import zlib

import pytest
import torch


def _gpu_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from flashquant_hf.backend import cupy_available

    return cupy_available()


def pytest_collection_modifyitems(config, items):
    for item in items:  # everything under tests/gpu/ is a GPU test
        if "/tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
    if _gpu_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _torch_threads():
    # Under pytest-xdist the workers share the cores: one thread each keeps them from oversubscribing.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))


@pytest.fixture
def rng_seed(request) -> int:
    """A seed fixed by the test's id: the same on every run and in every xdist worker, different per parameter."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture(autouse=True)
def _seeded_global_rng(rng_seed):
    """What still draws from torch's global RNG (model initialisation, sampling in generate) draws from the test's
    seed, and the state it found is restored: results do not depend on which tests ran before."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng_seed)
        yield


@pytest.fixture
def gen(rng_seed) -> torch.Generator:
    """A CPU generator seeded by the test's id."""
    return torch.Generator().manual_seed(rng_seed)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A directory with a tiny random Llama (2 layers, 2 KV heads, head_dim 16) and a byte-level tokenizer (256
    tokens, no merges), built in code and saved as a local model for `--model` (nothing downloads)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(alphabet), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)
    return path
