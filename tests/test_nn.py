"""fusedattn.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same weights."""

import itertools

import pytest
import torch

import fusedattn
from fusedattn.nn import MultiheadAttention, swap_attention

E, H = 32, 4


def pair(**kwargs):
    torch.manual_seed(0)
    ours = MultiheadAttention(E, H, **kwargs)
    theirs = torch.nn.MultiheadAttention(E, H, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def inputs(batch_first, n=3, l=7, s=11, kdim=E, vdim=E, self_attention=False, requires_grad=False):
    g = torch.Generator().manual_seed(1)
    shape = lambda length, dim: (n, length, dim) if batch_first else (length, n, dim)  # noqa: E731
    q = torch.randn(shape(l, E), generator=g)
    if self_attention:
        return [q.requires_grad_(requires_grad)] * 3
    k, v = torch.randn(shape(s, kdim), generator=g), torch.randn(shape(s, vdim), generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def masks(kind, n=3, l=7, s=11):
    g = torch.Generator().manual_seed(2)
    kpm = attn = None
    if "kpm_bool" in kind:
        kpm = torch.rand(n, s, generator=g) < 0.3
        kpm[:, 0] = False  # never a fully masked row: PyTorch would give NaN there
    if "kpm_float" in kind:
        kpm = torch.randn(n, s, generator=g)
    if "attn_bool" in kind:
        attn = torch.rand(l, s, generator=g) < 0.3
        attn[:, 1] = False
    if "attn_float" in kind:
        attn = torch.randn(l, s, generator=g)
    if "attn_3d" in kind:
        attn = torch.rand(n * H, l, s, generator=g) < 0.3
        attn[..., 2] = False
    return kpm, attn


def assert_same_results(ours, theirs):
    """(output, the input's gradient, the parameters' gradients) of our module and PyTorch's."""
    (out, g_in, g_params), (ref, ref_g_in, ref_g_params) = ours, theirs
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_in, ref_g_in, atol=1e-4, rtol=1e-4)
    for a, b in zip(g_params, ref_g_params):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


MASK_CASES = ["none", "kpm_bool", "kpm_float", "attn_bool", "attn_float", "attn_3d",
              "kpm_bool+attn_bool", "kpm_bool+attn_float", "kpm_float+attn_3d"]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask_case", MASK_CASES)
@pytest.mark.parametrize("need_weights", [False, True])
def test_matches_torch(batch_first, mask_case, need_weights):
    ours, theirs = pair(batch_first=batch_first)
    q, k, v = inputs(batch_first)
    kpm, attn = masks(mask_case)
    for module in (ours, theirs):
        module.eval()
    out, w = ours(q, k, v, key_padding_mask=kpm, need_weights=need_weights, attn_mask=attn)
    ref, ref_w = theirs(q, k, v, key_padding_mask=kpm, need_weights=need_weights, attn_mask=attn)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (w is None) == (ref_w is None)
    if w is not None:
        torch.testing.assert_close(w, ref_w)


@pytest.mark.parametrize("kwargs", [
    dict(bias=False), dict(kdim=20, vdim=12), dict(kdim=20, vdim=12, bias=False),
    dict(add_bias_kv=True), dict(add_zero_attn=True), dict(dropout=0.3),
], ids=str)
@pytest.mark.parametrize("batch_first", [False, True])
def test_constructor_options_forward_and_backward(kwargs, batch_first):
    ours, theirs = pair(batch_first=batch_first, **kwargs)
    kdim, vdim = kwargs.get("kdim", E), kwargs.get("vdim", E)
    grads = []
    for module in (ours, theirs):
        module.train()
        q, k, v = inputs(batch_first, kdim=kdim, vdim=vdim, requires_grad=True)
        kpm, attn = masks("kpm_bool+attn_float")
        torch.manual_seed(3)  # the same dropout draws on both paths
        out, _ = module(q, k, v, key_padding_mask=kpm, need_weights=False, attn_mask=attn)
        out.square().sum().backward()
        grads.append((out, q.grad, [p.grad for p in module.parameters()]))
    assert_same_results(*grads)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask_case", ["none", "kpm_bool+attn_float"])
def test_self_attention_projects_q_k_and_v_in_one_product(batch_first, mask_case, monkeypatch):
    """query is key is value: one in-projection (and the out-projection), the same outputs and
    gradients as PyTorch's; distinct tensors take three in-projections."""
    ours, theirs = pair(batch_first=batch_first)
    kpm, attn = masks(mask_case, s=7)
    linear, products = torch.nn.functional.linear, []
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **kw: products.append(1) or linear(*a, **kw))
    results = []
    for module in (ours, theirs):
        x = inputs(batch_first, s=7, self_attention=True, requires_grad=True)[0]
        products.clear()
        out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=False, attn_mask=attn)
        if module is ours:
            assert len(products) == 2, products
        out.square().sum().backward()
        results.append((out, x.grad, [p.grad for p in module.parameters()]))
    assert_same_results(*results)
    q, k, v = inputs(batch_first, s=7)
    products.clear()
    ours(q, k, v, need_weights=False)
    assert len(products) == 4


@pytest.mark.parametrize("average", [False, True])
def test_attention_weights_returned(average):
    ours, theirs = pair(batch_first=True)
    q, k, v = inputs(True)
    out, w = ours(q, k, v, average_attn_weights=average)
    ref, ref_w = theirs(q, k, v, average_attn_weights=average)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w, ref_w)


@pytest.mark.parametrize("l,s", [(9, 9), (5, 9)])
def test_is_causal_hint(l, s):
    ours, theirs = pair(batch_first=True)
    q, k, v = inputs(True, l=l, s=s)
    causal = torch.ones(l, s, dtype=torch.bool).tril().logical_not()  # True = masked
    out, _ = ours(q, k, v, need_weights=False, attn_mask=causal, is_causal=True)
    ref, _ = theirs(q, k, v, need_weights=False, attn_mask=causal, is_causal=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="is_causal"):
        ours(q, k, v, need_weights=False, is_causal=True)


def test_unbatched_input():
    ours, theirs = pair()
    q, k, v = (t[:, 0] for t in inputs(False))  # (L, E)
    kpm = torch.zeros(11, dtype=torch.bool)
    kpm[3] = True
    out, _ = ours(q, k, v, key_padding_mask=kpm, need_weights=False)
    ref, _ = theirs(q, k, v, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fused_path_is_taken(monkeypatch):
    calls = []
    real = fusedattn.nn.attention
    monkeypatch.setattr(fusedattn.nn, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ours, _ = pair(batch_first=True)
    q, k, v = inputs(True)
    ours(q, k, v, need_weights=False)
    assert calls == [1]
    ours(q, k, v)  # need_weights=True: PyTorch's path
    assert calls == [1]


def test_state_dict_round_trip():
    ours, theirs = pair(kdim=20, vdim=12, add_bias_kv=True)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    theirs2 = torch.nn.MultiheadAttention(E, H, kdim=20, vdim=12, add_bias_kv=True)
    theirs2.load_state_dict(ours.state_dict())
    ours2 = MultiheadAttention(E, H, kdim=20, vdim=12, add_bias_kv=True)
    ours2.load_state_dict(theirs.state_dict())
    for a, b in itertools.zip_longest(ours2.parameters(), theirs2.parameters()):
        assert torch.equal(a, b)


def test_swap_attention_in_transformer_encoder_and_decoder():
    torch.manual_seed(0)
    model = torch.nn.Transformer(d_model=E, nhead=H, num_encoder_layers=2, num_decoder_layers=2,
                                 dim_feedforward=64, dropout=0.0, batch_first=True).eval()
    src, tgt = torch.randn(2, 13, E), torch.randn(2, 9, E)
    tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(9)
    src_pad = torch.zeros(2, 13, dtype=torch.bool)
    src_pad[1, 10:] = True
    with torch.no_grad():
        expected = model(src, tgt, tgt_mask=tgt_mask, src_key_padding_mask=src_pad,
                         memory_key_padding_mask=src_pad, tgt_is_causal=True)
        swapped = swap_attention(model)
        assert swapped is model
        kinds = {type(m) for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)}
        assert kinds == {MultiheadAttention}
        out = model(src, tgt, tgt_mask=tgt_mask, src_key_padding_mask=src_pad,
                    memory_key_padding_mask=src_pad, tgt_is_causal=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_swapped_encoder_compiles_without_graph_breaks():
    torch._dynamo.reset()
    layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    encoder = swap_attention(torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False))
    x = torch.randn(2, 10, E)
    explanation = torch._dynamo.explain(encoder)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.testing.assert_close(torch.compile(encoder, fullgraph=True)(x), encoder(x),
                               atol=1e-5, rtol=1e-5)


def test_integer_masks_are_refused_like_torch():
    ours, theirs = pair(batch_first=True)
    q, k, v = inputs(True)
    pad = torch.zeros(3, 11, dtype=torch.uint8)
    for module in (ours, theirs):
        with pytest.raises(AssertionError, match="only bool and floating types"):
            module(q, k, v, key_padding_mask=pad, need_weights=False)


def test_gradient_flows_into_a_learned_float_mask():
    ours, theirs = pair(batch_first=True)
    q, k, v = inputs(True)
    grads = []
    for module in (ours, theirs):
        bias = torch.randn(7, 11, generator=torch.Generator().manual_seed(4)).requires_grad_()
        out, _ = module(q, k, v, attn_mask=bias, need_weights=False)
        out.sum().backward()
        grads.append((out, bias.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=1e-5)


def test_unbatched_3d_attn_mask_and_bfloat16():
    ours, theirs = pair()
    q, k, v = (t[:, 0] for t in inputs(False))  # (L, E)
    mask = torch.rand(H, 7, 11, generator=torch.Generator().manual_seed(5)) < 0.3
    mask[..., 0] = False
    out, _ = ours(q, k, v, attn_mask=mask, need_weights=False)
    ref, _ = theirs(q, k, v, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    ours, theirs = ours.bfloat16().eval(), theirs.bfloat16().eval()
    bias = torch.randn(7, 11).bfloat16()
    out, _ = ours(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=bias, need_weights=False)
    ref, _ = theirs(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=bias, need_weights=False)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


def test_the_vit_example_times_both_attentions_and_their_logits_agree():
    """examples/vit.py, tiny and eager: a row per attention, the ratios, and logits within float32's rounding
    (the example exits 1 otherwise)."""
    import pathlib
    import re
    import subprocess
    import sys

    example = pathlib.Path(__file__).parent.parent / "examples" / "vit.py"
    run = subprocess.run([sys.executable, str(example), "--device", "cpu", "--depth", "2", "--dim", "64", "--heads",
                          "2", "--image", "32", "--patch", "8", "--batch", "3", "--repeats", "2", "--warmup", "1",
                          "--no-compile"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "ViT: 2 layers, 2 heads of 32, 17 tokens, batch 3, cpu (float32)" in run.stdout
    assert re.search(r"eager +sdpa +[\d.]+ +[\d.]+", run.stdout) and re.search(r"eager +fusedattn +[\d.]+", run.stdout)
    assert re.search(r"eager: fusedattn's time / SDPA's: forward [\d.]+, train step [\d.]+", run.stdout)
    difference = float(re.search(r"max \|logits fusedattn - sdpa\| = (\S+)", run.stdout).group(1))
    assert difference < 1e-4
