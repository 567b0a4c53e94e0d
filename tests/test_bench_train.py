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


def test_bfloat16_autocast_keeps_the_attention_in_one_dtype():
    """Under autocast the rotary positions stay in q's dtype, so fusedattn's column runs (q, k and v
    of one dtype) and follows SDPA's within bfloat16 rounding."""
    cfg = bench_train.default_config(torch.device("cpu"), "tiny")
    cfg.dtypes, cfg.repeats, cfg.warmup = ["bfloat16"], 4, 1
    result = bench_train.run(cfg, progress=False)
    assert [result["rows"][0]["results"][m]["status"] for m in ("fusedattn", "sdpa")] == ["ok", "ok"]
    assert bench_train.loss_gap(result, "sdpa", "fusedattn") < 1e-2


def test_the_loss_gap_of_a_diverged_column_is_infinite():
    row = {"results": {"a": {"status": "ok", "losses": [4.5, 4.4, 4.3]},
                       "b": {"status": "ok", "losses": [4.5, float("nan"), float("nan")]},
                       "c": {"status": "n/a (no kernel)"}}}
    result = {"rows": [row]}
    assert bench_train.loss_gap(result, "b", "a") == float("inf")
    assert bench_train.loss_gap(result, "c", "a") is None
    assert bench_train.loss_gap(result, "a", "a") == 0.0


def test_the_table_shows_the_gap_between_the_anchors_themselves():
    """Two SDPA columns: the table's last line is their own largest gap (the scale a user reads
    fusedattn's against); with one anchor there is no such line."""
    ok = {"status": "ok", "seconds": 0.1, "tokens_per_s": 10.0, "peak_bytes": 1}
    row = {"model": "tiny", "results": {"fusedattn": dict(ok, losses=[4.5, 4.4]), "x": dict(ok, losses=[4.5, 4.3]),
                                        "y": dict(ok, losses=[4.5, 4.0])}}
    result = {"date": "d", "device": "cpu", "device_type": "cpu", "torch": "t", "methods": ["fusedattn", "x", "y"],
              "config": {"train": "tiny", "shape": vars(bench_train.MODELS["tiny"]), "dtype": "float32",
                         "repeats": 1, "warmup": 1, "compile": False}, "rows": [row]}
    last = bench_train.format_table(result).splitlines()[-1]
    assert last.startswith("loss gap between x, y themselves: 3.00e-01")
    result["methods"] = ["fusedattn", "x"]
    assert "themselves" not in bench_train.format_table(result)


def test_the_learning_rate_warms_up_over_the_warmup_steps():
    cfg = bench_train.default_config(torch.device("cpu"), "tiny")
    cfg.warmup = 4
    data = bench_train.batches(bench_train.MODELS["tiny"], 5, cfg.device, cfg.seed)
    trainer = bench_train.Trainer(cfg, "sdpa", data)
    rates = []
    for _ in range(5):
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.step()
    lr = bench_train.MODELS["tiny"].lr
    assert rates == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr, lr])


def test_each_sdpa_column_compiles_its_own_backend():
    """The backend is held inside the attention function, so a compiled column cannot reuse another
    SDPA column's graph: held to the efficient backend (none on the CPU) the call fails, where the
    flash one (the CPU's) compiled first runs."""
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    flash = torch.compile(bench_train.attention_of("sdpa-flash"), backend="eager")
    efficient = torch.compile(bench_train.attention_of("sdpa-efficient"), backend="eager")
    torch.testing.assert_close(flash(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    with pytest.raises(RuntimeError):
        efficient(q, k, v)


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
