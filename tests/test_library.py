"""torch.library integration: opcheck, torch.compile (static, dynamic, backward,
no graph breaks in a model)."""

import pytest
import torch
import torch._dynamo

import fusedattn
from helpers.attention_cases import Case, check_forward, make_inputs

OPCHECK_CASES = [
    Case(),
    Case(dtype=torch.bfloat16, mask="bool", is_causal=True),
    Case(dtype=torch.float16, mask="additive", seqlen_q=1, seqlen_k=40),
    Case(heads_q=6, heads_kv=1, mask="key_padding", seqlen_q=97, seqlen_k=113, head_dim=16),
    Case(mask="fully_masked_rows", scale=0.3),
    Case(mask="rows_2d", is_causal=True, seqlen_q=50, seqlen_k=20),
]


def sample_inputs(requires_grad=False):
    for case in OPCHECK_CASES:
        q, k, v, mask = make_inputs(case, requires_grad=requires_grad)
        yield case, (q, k, v, mask, case.is_causal, case.scale)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_forward(requires_grad):
    for _, args in sample_inputs(requires_grad):
        torch.library.opcheck(torch.ops.fusedattn.forward.default, args)


def test_opcheck_backward():
    for case, (q, k, v, mask, causal, scale) in sample_inputs():
        out, lse = torch.ops.fusedattn.forward(q, k, v, mask, causal, scale)
        grad_out = torch.randn_like(out)
        torch.library.opcheck(torch.ops.fusedattn.backward.default,
                              (grad_out, q, k, v, out, lse, mask, causal, scale))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_forward_and_backward(dynamic):
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=dynamic)
    def f(q, k, v, mask):
        return fusedattn.attention(q, k, v, mask, is_causal=True) * 2

    for n in (40, 57, 90):  # several lengths: recompiles (static) or one graph (dynamic)
        case = Case(seqlen_q=n, seqlen_k=n + 5, mask="key_padding", is_causal=True)
        q, k, v, mask = make_inputs(case, requires_grad=True)
        out = f(q, k, v, mask)
        expected = fusedattn.attention(q, k, v, mask, is_causal=True) * 2
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e, atol=0, rtol=0)


def test_compile_returns_correct_lse():
    torch._dynamo.reset()
    case = Case(mask="fully_masked_rows")
    q, k, v, mask = make_inputs(case)
    out, lse = torch.compile(torch.ops.fusedattn.forward, fullgraph=True)(q, k, v, mask)
    check_forward(case, out=out, lse=lse)


class TinyAttentionBlock(torch.nn.Module):
    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, N, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = fusedattn.attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, N, -1))


def test_model_has_no_graph_breaks():
    torch._dynamo.reset()
    model = TinyAttentionBlock()
    x = torch.randn(2, 37, 64, requires_grad=True)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1

    compiled = torch.compile(model, fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, model(x), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    assert x.grad is not None and not x.grad.isnan().any()


def test_importing_fusedattn_leaves_dynamo_unloaded():
    """Dynamo's import costs seconds (more than torch's on a small CPU); a process that never
    compiles (the CLI, a server, eager inference) must not pay it for fusedattn."""
    import subprocess
    import sys

    code = "import sys, fusedattn; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_the_constant_result_mark_is_torch_compilers_own():
    """fusedattn._compile marks a function as torch.compiler.assume_constant_result would (which
    it cannot call before Dynamo is loaded): a torch whose decorator does more fails here."""
    from fusedattn import backends, ops

    def ours():
        return 1

    def theirs():
        return 1

    marked = torch.compiler.assume_constant_result(theirs)
    assert marked is theirs and theirs.__dict__ == {"_dynamo_marked_constant": True}
    ours._dynamo_marked_constant = True  # what _compile does without Dynamo
    assert ours.__dict__ == theirs.__dict__
    for fn in (backends._nothing_forced_while_tracing, ops._planned_fused):
        assert fn.__dict__.get("_dynamo_marked_constant") is True
