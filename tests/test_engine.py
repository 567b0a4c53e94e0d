"""The inference engine: our Llama decoder on fusedattn against transformers' generate."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the models extra: pip install .[models]")
pytest.importorskip("gguf", reason="needs the models extra: pip install .[models]")

from fusedattn import cli  # noqa: E402
from fusedattn.engine import Engine, SamplingParams, smollm2_path  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Attention is all you",
           "List three colours of the rainbow: red,"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def engine():
    try:
        path = smollm2_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    return Engine.from_gguf(path)


def until_eos(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def run(engine, prompts, **kwargs):
    out = [[] for _ in prompts]
    for step in engine.generate(prompts, **kwargs):
        for seq, token in zip(out, step):
            if token is not None:
                seq.append(token)
    return out


def test_greedy_tokens_match_transformers_generate(engine):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), attn_implementation="sdpa").eval()
    tokenizer = engine.tokenizer
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hf = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id)
    ours = run(engine, PROMPTS, max_new_tokens=NEW_TOKENS)
    eos = tokenizer.eos_token_id
    for i, prompt in enumerate(PROMPTS):
        expected = until_eos(hf[i, batch["input_ids"].shape[1]:].tolist(), eos)
        assert until_eos(ours[i], eos) == expected, prompt


def test_sampling_is_seeded_and_top_k_1_is_greedy(engine):
    greedy = run(engine, PROMPTS[:2], max_new_tokens=8)
    top1 = run(engine, PROMPTS[:2], max_new_tokens=8, sampling=SamplingParams(temperature=0.8, top_k=1))
    assert top1 == greedy
    hot = SamplingParams(temperature=1.5, top_p=0.95, seed=7)
    first, again = (run(engine, PROMPTS[:2], max_new_tokens=12, sampling=hot) for _ in range(2))
    assert first == again
    other = run(engine, PROMPTS[:2], max_new_tokens=12, sampling=SamplingParams(1.5, 0, 0.95, seed=8))
    assert other != first


def test_stop_tokens_end_a_sequence(engine):
    greedy = run(engine, PROMPTS[:1], max_new_tokens=6)[0]
    stopped = run(engine, PROMPTS[:1], max_new_tokens=6, stop_tokens={greedy[2]})[0]
    assert stopped == greedy[:3]


def test_generate_command_line(capsys, engine):
    assert cli.main(["generate", "The capital of France is", "--max-new-tokens", "5",
                     "--batch", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The capital of France is") and "--- sequence 1:" in out
    assert "prefill:" in out and "decode:" in out
