"""`fusedattn bench --train`: each method trains its own copy of the model from one seed on the
same batches, so the loss curves of two correct attentions agree, and a wrong one shows."""

import pytest
import torch
import torch.nn.functional as F

import fusedattn
from fusedattn import bench_train


def tiny_run(repeats: int = 12) -> dict:
    cfg = bench_train.default_config(torch.device("cpu"), "tiny")
    cfg.repeats, cfg.warmup = repeats, 1
    return bench_train.run(cfg, progress=False)


def test_fusedattn_and_sdpa_train_alike(monkeypatch):
    """Both columns run every step, fusedattn's through fusedattn.attention (counted), the losses
    fall over the steps and stay within float32 rounding of SDPA's at every step."""
    calls = []
    attention = fusedattn.attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return attention(*args, **kwargs)

    monkeypatch.setattr(fusedattn, "attention", counted)
    result = tiny_run(repeats=30)
    shape = bench_train.MODELS["tiny"]
    steps = 1 + 1 + 30  # warm-up, the peak-memory step, the timed ones
    assert len(calls) == steps * shape.layers
    assert all(s == (shape.batch, shape.heads, shape.seqlen, shape.d_model // shape.heads) for s in calls)
    for method in ("fusedattn", "sdpa"):
        r = result["rows"][0]["results"][method]
        assert r["status"] == "ok" and len(r["losses"]) == steps
        assert r["tokens_per_s"] == pytest.approx(shape.batch * shape.seqlen / r["seconds"])
        assert r["losses"][-1] < r["losses"][0] - 0.05  # the repeated blocks are learnt
    assert bench_train.loss_gap(result, "sdpa", "fusedattn") < 1e-4
    table = bench_train.format_table(result)
    assert "tokens/s" in table and "loss gap" in table


def test_a_wrong_attention_shows_in_the_loss_gap(monkeypatch):
    """fusedattn's column made non-causal (each token sees its future): the gap is large."""
    monkeypatch.setattr(fusedattn, "attention",
                        lambda q, k, v, is_causal: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    assert bench_train.loss_gap(tiny_run(), "sdpa", "fusedattn") > 1e-2


def test_the_batches_repeat_a_block_and_the_model_is_seeded():
    s = bench_train.MODELS["tiny"]
    (batch,) = bench_train.batches(s, 1, torch.device("cpu"), seed=3)
    assert batch.shape == (s.batch, s.seqlen)
    assert torch.equal(batch[:, s.period:2 * s.period], batch[:, :s.period])
    assert not torch.equal(batch[0], batch[1])
    cfg = bench_train.default_config(torch.device("cpu"), "tiny")
    a, b = (bench_train.Trainer(cfg, m, [batch]) for m in ("fusedattn", "sdpa"))
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))


def test_the_compiled_step_trains_as_the_eager_one():
    """torch.compile (CUDA's default) around the model: fusedattn's operators trace, and the
    compiled fusedattn column's losses follow eager SDPA's."""
    cfg = bench_train.default_config(torch.device("cpu"), "tiny")
    cfg.repeats, cfg.warmup = 2, 1
    data = bench_train.batches(bench_train.MODELS["tiny"], 4, cfg.device, cfg.seed)
    eager = bench_train.Trainer(cfg, "sdpa", data)
    cfg.compile = True
    compiled = bench_train.Trainer(cfg, "fusedattn", data)
    for _ in range(4):
        eager.step()
        compiled.step()
    assert max(abs(a - b) for a, b in zip(eager.losses, compiled.losses)) < 1e-4
