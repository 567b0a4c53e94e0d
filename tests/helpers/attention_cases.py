"""Shared test inputs and the tolerance rule (docs/architecture.md).

Every correctness test compares a kernel against ``fusedattn.reference`` run in
float64 (the oracle) and allows at most ``factor`` times the error that the
same reference makes in the input dtype, plus a small absolute floor.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

import fusedattn
from fusedattn import reference

# Absolute error floors per dtype, in units of the output's magnitude (outputs
# are convex combinations of v, whose entries are about N(0, 1)).
FLOOR = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

MASK_KINDS = (
    "none",
    "bool",  # full [B, Hq, Nq, Nk]
    "additive",  # full, float, with some -inf
    "key_padding",  # bool [B, 1, 1, Nk]
    "key_padding_additive",  # float [B, 1, 1, Nk] with -inf padding
    "per_head",  # bool [1, Hq, Nq, Nk]
    "rows_2d",  # bool [Nq, Nk], broadcast over batch and heads
    "fully_masked_rows",  # bool with whole query rows hidden
    "key_block_holes",  # bool [B, 1, 1, Nk] hiding keys 64-191 and 256-767: whole tiles skipped
    "documents",  # bool [Nq, Nk]: causal documents of 1-300 tokens packed (bottom-right aligned)
    "sparse_blocks",  # float [1, Hq, Nq, Nk]: 64 x 64 blocks all -inf, all 0 or random
)
# Masks whose structure shows at the GPU's tiles (128 x 128 on sm90): for the
# longer GPU cases of tests/test_mask_tiles.py.
TILE_MASK_KINDS = (
    "key_lengths",  # bool [B, 1, 1, Nk]: sequence b's keys end at Nk x 1, 1/2, 1/4, 3/4 (b mod 4)
    "sparse_tiles",  # float [1, Hq, Nq, Nk]: 128 x 128 blocks all -inf, all 0 or random
    "hidden_query_tiles",  # bool [B, Hq, Nq, Nk]: random, but queries 128-383 see nothing
    "documents",
)


@dataclasses.dataclass
class Case:
    batch: int = 2
    heads_q: int = 4
    heads_kv: int = 2
    seqlen_q: int = 33
    seqlen_k: int = 47
    head_dim: int = 32
    head_dim_v: int | None = None  # v's and out's head dim; None: head_dim
    dtype: torch.dtype = torch.float32
    mask: str = "none"
    is_causal: bool = False
    scale: float | None = None
    window: tuple[int, int] | None = None  # (left, right), -1 unbounded
    seed: int = 0
    softcap: float | None = None
    sinks: bool = False  # a float32 [Hq] of sinks (make_sinks), differentiable

    def __str__(self) -> str:
        s = (
            f"B{self.batch}-H{self.heads_q}/{self.heads_kv}-N{self.seqlen_q}x{self.seqlen_k}"
            f"-d{self.head_dim}" + (f"-dv{self.head_dim_v}" if self.head_dim_v else "")
            + f"-{str(self.dtype)[6:]}-{self.mask}"
        )
        return (s + ("-causal" if self.is_causal else "") + (f"-s{self.scale}" if self.scale else "")
                + (f"-w{self.window[0]},{self.window[1]}" if self.window else "")
                + (f"-cap{self.softcap}" if self.softcap else "") + ("-sinks" if self.sinks else ""))

    def options(self, sinks=None) -> tuple:
        """The call's arguments after q, k, v and the mask, as reference.attention takes them."""
        return self.is_causal, self.scale, self.window, self.softcap, sinks


def make_mask(case: Case, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor | None:
    B, H, Nq, Nk = case.batch, case.heads_q, case.seqlen_q, case.seqlen_k

    def rand(*shape):
        return torch.rand(*shape, generator=generator)

    kind = case.mask
    if kind == "none":
        return None
    if kind == "bool":
        return rand(B, H, Nq, Nk) > 0.25
    if kind == "additive":
        m = torch.randn(B, H, Nq, Nk, generator=generator)
        return m.masked_fill(rand(B, H, Nq, Nk) < 0.2, float("-inf")).to(dtype)
    if kind == "key_padding":
        keep = rand(B, 1, 1, Nk) > 0.3
        keep[..., 0] = True
        return keep
    if kind == "key_padding_additive":
        pad = rand(B, 1, 1, Nk) < 0.3
        pad[..., 0] = False
        return torch.zeros(B, 1, 1, Nk).masked_fill(pad, float("-inf")).to(dtype)
    if kind == "per_head":
        return rand(1, H, Nq, Nk) > 0.5
    if kind == "rows_2d":
        return rand(Nq, Nk) > 0.4
    if kind == "key_block_holes":
        keep = torch.ones(B, 1, 1, Nk, dtype=torch.bool)
        keep[..., 64:192] = False
        keep[..., 256:768] = False
        return keep
    if kind == "documents":
        lengths = torch.randint(1, 301, (Nk,), generator=generator)
        doc_of_key = torch.repeat_interleave(torch.arange(Nk), lengths)[:Nk]
        position = torch.arange(Nq) + (Nk - Nq)  # the query's key position
        doc_of_query = torch.where(position >= 0, doc_of_key[position.clamp(min=0)], -1)
        keys = torch.arange(Nk)
        return (doc_of_query[:, None] == doc_of_key[None, :]) & (keys[None, :] <= position[:, None])
    if kind in ("sparse_blocks", "sparse_tiles"):
        size = 64 if kind == "sparse_blocks" else 128
        blocks = torch.randint(0, 3, (1, H, (Nq + size - 1) // size, (Nk + size - 1) // size), generator=generator)
        blocks = blocks.repeat_interleave(size, 2).repeat_interleave(size, 3)[..., :Nq, :Nk]
        values = torch.randn(1, H, Nq, Nk, generator=generator)
        m = torch.where(blocks == 0, float("-inf"), torch.where(blocks == 1, 0.0, values))
        return m.to(dtype)
    if kind == "key_lengths":
        ends = torch.tensor([Nk, Nk // 2 + 1, Nk // 4 + 3, 3 * Nk // 4 - 5]).clamp(min=1)[torch.arange(B) % 4]
        return (torch.arange(Nk)[None, :] < ends[:, None]).view(B, 1, 1, Nk)
    if kind == "hidden_query_tiles":
        m = rand(B, H, Nq, Nk) > 0.25
        m[:, :, 128:384, :] = False
        return m
    if kind == "fully_masked_rows":
        m = rand(B, H, Nq, Nk) > 0.25
        m[:, :, ::3, :] = False  # every third query sees nothing
        return m
    raise ValueError(kind)


def make_inputs(case: Case, device="cpu", requires_grad=False):
    """q, k, v (random normal, never zeros) and the mask of a case."""
    g = torch.Generator().manual_seed(case.seed)
    shape_q = (case.batch, case.heads_q, case.seqlen_q, case.head_dim)
    shape_kv = (case.batch, case.heads_kv, case.seqlen_k, case.head_dim)
    shape_v = (*shape_kv[:3], case.head_dim_v or case.head_dim)
    q, k, v = (torch.randn(s, generator=g) for s in (shape_q, shape_kv, shape_v))
    mask = make_mask(case, g, case.dtype)
    q, k, v = (t.to(device=device, dtype=case.dtype).requires_grad_(requires_grad) for t in (q, k, v))
    return q, k, v, (mask.to(device) if mask is not None else None)


def make_sinks(case: Case, device="cpu", requires_grad=False) -> torch.Tensor | None:
    """The case's sinks, float32 [Hq] around the scores' size (so that they
    take a visible share of each row), or None."""
    if not case.sinks:
        return None
    g = torch.Generator().manual_seed(case.seed + 7)
    return (2 * torch.randn(case.heads_q, generator=g)).to(device).requires_grad_(requires_grad)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within_rule(name, actual, oracle, low_precision, dtype, factor, scale=1.0, extra=0.0):
    """err(actual) <= factor * err(low_precision reference) + floor (+ `extra`:
    an error the algorithm cannot avoid, which the reference does not make)."""
    err = max_err(actual, oracle)
    ref_err = max_err(low_precision, oracle)
    bound = factor * ref_err + FLOOR[dtype] * scale + extra
    assert err <= bound, f"{name}: error {err:.3g} > {factor} x reference error {ref_err:.3g} + floor"
    assert not actual.isnan().any(), f"{name}: NaN in output"


def check_forward(case: Case, device="cpu", out=None, lse=None):
    """Runs the fused forward (unless out is given) and checks out, and lse
    unless out was given without it."""
    q, k, v, mask = make_inputs(case, device)
    sinks = make_sinks(case, device)
    if out is None:
        out, lse = torch.ops.fusedattn.forward(q, k, v, mask, case.is_causal, case.scale, window=case.window,
                                               softcap=case.softcap, sinks=sinks)
    args = (mask, *case.options(sinks))
    oracle, oracle_lse = reference.attention_with_lse(q.double(), k.double(), v.double(), *args)
    low, _ = reference.attention_with_lse(q, k, v, *args)
    assert out.shape == (*q.shape[:3], v.shape[3]) and out.dtype == q.dtype
    assert_within_rule("out", out, oracle, low, case.dtype, factor=2)

    # lse: -inf exactly where the oracle's is, otherwise float32-accurate.
    hidden = oracle_lse == float("-inf")
    finite = ~hidden
    if lse is not None:
        assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
        assert torch.equal(lse == float("-inf"), hidden.to(lse.device)), "lse: -inf pattern differs"
    if lse is not None and finite.any():
        lse_err = max_err(lse[finite], oracle_lse[finite])
        assert lse_err <= 1e-4 * (1 + oracle_lse[finite].abs().max().item()), f"lse error {lse_err}"
    if hidden.any():  # fully masked rows are exactly zero
        assert (out[hidden.to(out.device)] == 0).all(), "fully masked rows must be 0"
    return out, lse


def default_grad_out(case: Case, device="cpu") -> torch.Tensor:
    """The case's grad_out, [B, Hq, Nq, d_v] in its dtype, from its own seed."""
    g = torch.Generator().manual_seed(case.seed + 1)
    shape = (case.batch, case.heads_q, case.seqlen_q, case.head_dim_v or case.head_dim)
    return torch.randn(shape, generator=g).to(device=device, dtype=case.dtype)


def check_backward(case: Case, device="cpu", grads=None, grad_out=None):
    """Gradients of q, k, v (and the sinks) through fusedattn.attention (or
    `grads`, computed by the caller from make_inputs(case) and `grad_out`)
    against autograd of the reference."""
    q, k, v, mask = make_inputs(case, device, requires_grad=True)
    sinks = make_sinks(case, device, requires_grad=True)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    if grad_out is None:
        grad_out = default_grad_out(case, device)

    if grads is None:
        out = fusedattn.attention(q, k, v, mask, *case.options(sinks))
        grads = torch.autograd.grad(out, inputs, grad_out)

    # The oracle in float64; the reference in the input dtype (sinks stay float32).
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    inputs_low = [t.detach().clone().requires_grad_() for t in inputs]
    oracle, low = (torch.autograd.grad(reference.attention(*ts[:3], mask, *case.options(_sinks_of(ts))), ts, dout)
                   for ts, dout in ((inputs64, grad_out.double()), (inputs_low, grad_out)))

    # Gradients grow with sqrt(N) and the scale; the floor follows their size
    # (the largest of the three: a gradient that is exactly 0 in the oracle,
    # such as dK where every query sees one key, still carries rounding).
    magnitude = max([1.0] + [o.abs().max().item() for o in oracle[:3] if o.numel()])
    args = (mask, *case.options(_sinks_of([t.detach() for t in inputs64])))
    stored_out = stored_output_error(*inputs64[:3], grad_out.double(), args, case.dtype)
    names = ("dq", "dk", "dv", "dsinks")
    for name, a, o, lp, like, extra in zip(names, grads, oracle, low, inputs, stored_out):
        assert a.shape == like.shape and a.dtype == like.dtype
        assert_within_rule(name, a, o, lp, case.dtype, factor=3, scale=magnitude, extra=extra)


def _sinks_of(inputs):
    """The sinks of check_backward's inputs (q, k, v[, sinks]), or None."""
    return inputs[3] if len(inputs) > 3 else None


def stored_output_error(q64, k64, v64, grad_out64, args, dtype) -> tuple[float, float, float, float]:
    """What a fused backward cannot avoid, on top of the rule: it takes delta =
    rowsum(dO * O) from the output as stored, rounded to the input dtype
    (FlashAttention's and cuDNN's backwards do the same), and dS = P (dP - delta)
    carries that rounding: dq moves by -scale (delta' - delta) P K, dk by
    -scale P^T ((delta' - delta) q) and a sink by -sum P_sink (delta' - delta).
    Measured in float64, as max errors of dq, dk, dv (dv does not read delta)
    and the sinks (0 without them). Under soft-capping the cap's slope (at most
    1) is left out, which can only overstate the shift."""
    mask, is_causal, scale, window, softcap, sinks = args
    scale = 1.0 / q64.shape[-1] ** 0.5 if scale is None else scale
    options = (is_causal, scale, window, softcap, sinks)
    with torch.no_grad():
        out, lse = reference.attention_with_lse(q64, k64, v64, mask, *options)
        shift = (grad_out64 * (out.to(dtype).double() - out)).sum(-1, keepdim=True)  # delta' - delta
        dq = scale * shift * reference.attention(q64, k64, k64, mask, *options)
        d_sinks = 0.0
        if sinks is not None:
            sink_mass = torch.exp(sinks.view(1, -1, 1) - lse).nan_to_num(0.0)
            d_sinks = max_err((sink_mass * shift.squeeze(-1)).sum((0, 2)), torch.zeros(sinks.shape[0], dtype=sinks.dtype, device=sinks.device))
    k_probe = k64.detach().clone().requires_grad_()  # as values: P^T (shift q) has dk's head dim
    (dk,) = torch.autograd.grad(reference.attention(q64.detach(), k64.detach(), k_probe, mask, *options),
                                (k_probe,), scale * shift * q64.detach())  # P^T (shift q), summed per kv head
    return max_err(dq, torch.zeros_like(dq)), max_err(dk, torch.zeros_like(dk)), 0.0, d_sinks


def windows(max_len: int):
    """(left, right) windows: each side unbounded (-1), 0, or up to max_len (wider than N too)."""
    side = st.one_of(st.just(-1), st.just(0), st.integers(1, max_len + 10))
    return st.tuples(side, side)


@st.composite
def cases(draw, max_len=300, with_windows=False, with_softcap_and_sinks=False):
    heads_kv = draw(st.integers(1, 3))
    return Case(
        batch=draw(st.integers(1, 3)),
        heads_kv=heads_kv,
        heads_q=heads_kv * draw(st.sampled_from([1, 2, 3])),
        seqlen_q=draw(st.one_of(st.sampled_from([1, 7, 97, 113]), st.integers(1, max_len))),
        seqlen_k=draw(st.one_of(st.sampled_from([1, 7, 97, 113]), st.integers(1, max_len))),
        head_dim=draw(st.sampled_from([1, 3, 8, 16, 32, 40, 64, 80, 96, 128, 256])),
        dtype=draw(st.sampled_from(DTYPES)),
        mask=draw(st.sampled_from(MASK_KINDS)),
        is_causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        window=draw(st.one_of(st.none(), windows(max_len))) if with_windows else None,
        seed=draw(st.integers(0, 2**16)),
        softcap=draw(st.one_of(st.none(), st.floats(0.05, 50.0))) if with_softcap_and_sinks else None,
        sinks=draw(st.booleans()) if with_softcap_and_sinks else False,
    )
