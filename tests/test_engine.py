"""The inference engine: our Llama decoder on fusedattn against transformers' generate."""

import io
import os
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the models extra: pip install .[models]")
pytest.importorskip("gguf", reason="needs the models extra: pip install .[models]")

from fusedattn import cli  # noqa: E402
from fusedattn.engine import Engine, SamplingParams, smollm2_path  # noqa: E402
from fusedattn.gguf_blocks import BlockWeight  # noqa: E402
from helpers import hf_models  # noqa: E402
from helpers.hf_tokenizers import pad_on_the_left  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Attention is all you",
           "List three colours of the rainbow: red,"]
NEW_TOKENS = 32


def load_engine(**kwargs):
    try:
        path = smollm2_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    return Engine.from_gguf(path, **kwargs)


@pytest.fixture(scope="module")
def engine():
    return load_engine()


@pytest.fixture(scope="module")
def cuda_engine():
    return load_engine(device="cuda")


def transformers_greedy(tokenizer, device="cpu", dtype=None):
    """transformers' own generate (SDPA) on the same GGUF file: the new tokens
    of each prompt, the logits of every step [B, steps, vocab], and the ids
    that end a sequence for either implementation (transformers releases
    differ in which end-of-text ids they read from the file; what follows
    the end is not compared)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = hf_models.causal_lm(smollm2_path(), "sdpa", device, dtype or torch.float32)
    pad_on_the_left(tokenizer)
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt").to(device)
    with torch.no_grad():
        hf = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    new = hf.sequences[:, batch["input_ids"].shape[1]:].tolist()
    stop = model.generation_config.eos_token_id
    stop = {tokenizer.eos_token_id} | (set(stop) if isinstance(stop, list) else {stop} - {None})
    return new, torch.stack(hf.logits, dim=1).float(), stop


def until_eos(tokens, eos):
    """tokens up to and including the first of the ids in eos (an int or a set)."""
    eos = {eos} if isinstance(eos, int) else eos
    end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
    return tokens[: end + 1]


def run(engine, prompts, **kwargs):
    out = [[] for _ in prompts]
    for step in engine.generate(prompts, **kwargs):
        for seq, token in zip(out, step):
            if token is not None:
                seq.append(token)
    return out


def test_a_files_end_of_turn_ends_a_reply(engine, monkeypatch):
    """The GGUF's end-of-turn and end-of-message ids (gguf_models.end_tokens) end a reply as end
    of text does, in generate and so in the server's batcher (Engine.stop_tokens)."""
    from fusedattn import gguf_models

    class Reader:
        fields = {"tokenizer.ggml.eot_token_id": type("F", (), {"contents": lambda self: 107})()}

    assert gguf_models.end_tokens(Reader()) == (107,)
    assert engine.stop_tokens() == {engine.tokenizer.eos_token_id}  # SmolLM2's file names neither
    free = run(engine, PROMPTS[:1], max_new_tokens=8)[0]
    monkeypatch.setattr(engine.config, "end_tokens", (free[2],))
    assert engine.stop_tokens() == {engine.tokenizer.eos_token_id, free[2]}
    assert run(engine, PROMPTS[:1], max_new_tokens=8)[0] == free[:free.index(free[2]) + 1]


def test_greedy_tokens_match_transformers_generate(engine):
    expected, _, eos = transformers_greedy(engine.tokenizer)
    ours = run(engine, PROMPTS, max_new_tokens=NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        assert until_eos(ours[i], eos) == until_eos(expected[i], eos), prompt


# In float16, two candidates whose logits are this close may swap between
# implementations (the logits carry errors of about 1e-2): greedy sequences
# are compared up to the first such near-tie.
NEAR_TIE = 0.1


@pytest.mark.gpu
def test_cuda_greedy_tokens_match_transformers_generate(cuda_engine):
    expected, logits, eos = transformers_greedy(cuda_engine.tokenizer, "cuda", cuda_engine.dtype)
    ours = run(cuda_engine, PROMPTS, max_new_tokens=NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        a, b = until_eos(ours[i], eos), until_eos(expected[i], eos)
        same = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if same < min(len(a), len(b)):
            top2 = logits[i, same].topk(2).values
            assert top2[0] - top2[1] < NEAR_TIE, (
                f"{prompt!r}: token {same} differs ({a[same]} against {b[same]}) where transformers' "
                f"top two logits are {float(top2[0] - top2[1]):.3f} apart")
        else:
            assert a == b, prompt
        assert same >= 8, f"{prompt!r}: only {same} tokens agree"


@pytest.mark.gpu
def test_cuda_graph_decoding_equals_eager(cuda_engine):
    eager = load_engine(device="cuda", cuda_graph=False)
    assert run(eager, PROMPTS, max_new_tokens=12) == run(cuda_engine, PROMPTS, max_new_tokens=12)


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


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One model cache for the command-line tests: the first converts, the others load."""
    return str(tmp_path_factory.mktemp("model-cache"))


def generate(capsys, cache_dir, *argv) -> str:
    assert cli.main(["generate", *argv, "--device", "cpu", "--cache-dir", cache_dir]) == 0
    return capsys.readouterr().out


def test_generate_command_line_continues_raw_text(capsys, cache_dir):
    out = generate(capsys, cache_dir, "The capital of France is", "--raw", "--max-new-tokens", "5", "--batch", "2")
    assert out.startswith("The capital of France is") and "--- sequence 1:" in out
    assert "prefill:" in out and "decode:" in out


def test_generate_answers_in_the_chat_template_by_default(capsys, cache_dir):
    out = generate(capsys, cache_dir, "What is the capital of France?", "--max-new-tokens", "16")
    assert out.startswith("> What is the capital of France?\n")
    assert "Paris" in out.splitlines()[1], out


def test_generate_in_bfloat16_answers_too(capsys, cache_dir):
    """bfloat16 weights and kernels end to end, on a completion a 135M model gets right at
    either precision: in the chat template, bfloat16's rounding (with transformers 5.24's
    tokenizer) turns its greedy answer to the question about France into French prose."""
    out = generate(capsys, cache_dir, "The capital of France is", "--raw", "--max-new-tokens", "8",
                   "--dtype", "bfloat16")
    assert out.startswith("The capital of France is Paris"), out
    out = generate(capsys, cache_dir, "What is the capital of Germany?", "--max-new-tokens", "16", "--dtype", "bfloat16")
    assert "Berlin" in out.splitlines()[1], out


def test_generate_takes_prompts_from_a_file_and_from_stdin(capsys, cache_dir, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n\nName a colour of the rainbow.\n")
    out = generate(capsys, cache_dir, "--prompt-file", str(prompts), "--max-new-tokens", "8")
    assert "=== prompt 1 of 2\n> What is the capital of France?" in out
    assert "=== prompt 2 of 2\n> Name a colour of the rainbow." in out
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n"))
    piped = generate(capsys, cache_dir, "--max-new-tokens", "8")
    assert piped.splitlines()[:2] == out.splitlines()[1:3]  # the same greedy answer


def test_generate_passes_its_penalties_on(capsys, cache_dir):
    """--presence-penalty and --frequency-penalty reach the sampler, each as itself: the text is
    the engine's under those penalties, and not under them swapped or left out."""
    prompt = "Red, orange, yellow,"
    engine = Engine.from_gguf(smollm2_path(), cache_dir=cache_dir)

    def engine_text(presence, frequency):
        sampling = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
        steps = engine.generate([prompt], 24, sampling)
        return prompt + engine.tokenizer.decode([s[0] for s in steps if s[0] is not None], skip_special_tokens=True)

    out = generate(capsys, cache_dir, prompt, "--raw", "--max-new-tokens", "24", "--presence-penalty", "2",
                   "--frequency-penalty", "-1").split("\nprefill:")[0]
    assert out == engine_text(2, -1) and len({out, engine_text(-1, 2), engine_text(0, 0)}) == 3


def test_generate_draws_a_fresh_seed_and_says_which(capsys, cache_dir):
    """Without --seed each sampled run has its own seed, printed first; passing it repeats the run."""
    argv = ("Tell me a story.", "--temperature", "1.2", "--max-new-tokens", "12")
    first, second = (generate(capsys, cache_dir, *argv) for _ in range(2))
    seeds = [int(re.match(r"sampling seed (\d+) ", out).group(1)) for out in (first, second)]
    assert seeds[0] != seeds[1] and first.splitlines()[2] != second.splitlines()[2]
    again = generate(capsys, cache_dir, *argv, "--seed", str(seeds[0]))
    assert again.splitlines()[:3] == first.splitlines()[:3]


def test_a_cached_model_loads_without_converting_and_decodes_the_same(engine, tmp_path, monkeypatch):
    import gguf

    from fusedattn import engine as engine_module

    path = smollm2_path()
    opened, real = [], gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: opened.append(a) or real(*a, **k))
    converted = Engine.from_gguf(path, cache_dir=str(tmp_path))  # converts and writes the entry
    assert len(opened) == 1  # the weights and the tokenizer read one parse of the file
    assert converted.chat_prompt("Hi") == engine.chat_prompt("Hi")
    monkeypatch.undo()
    (entry,) = (tmp_path / "models").iterdir()
    assert (entry / "weights.pt").is_file() and (entry / "tokenizer").is_dir()
    monkeypatch.setattr(engine_module, "read_model", lambda *a, **k: pytest.fail("converted again"))
    cached = Engine.from_gguf(path, cache_dir=str(tmp_path))
    assert isinstance(cached.layers[0]["qkv"], BlockWeight) and cached.lm_head is cached.embed
    assert run(cached, PROMPTS, max_new_tokens=8) == run(engine, PROMPTS, max_new_tokens=8)
    assert cached.chat_prompt("Hi") == engine.chat_prompt("Hi")
    # A fresh process's cached start imports no transformers (whose import costs a start ~0.5 s).
    code = ("import sys; from fusedattn.engine import Engine, smollm2_path; e = Engine.from_gguf(smollm2_path(), "
            "cache_dir=sys.argv[1]); print(e.chat_prompt('Hi there'), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         check=True).stdout
    ids, imported = out.strip().rsplit(" ", 1)
    assert imported == "False" and ids == str(engine.chat_prompt("Hi there"))


def test_on_the_cpu_the_engine_keeps_the_files_blocks_and_they_are_gguf_pys_values(engine):
    import gguf

    reader = gguf.GGUFReader(smollm2_path())
    tensors = {t.name: t for t in reader.tensors}
    assert isinstance(engine.embed, BlockWeight) and engine.lm_head is engine.embed
    pairs = [(engine.embed, ["token_embd"]), (engine.layers[0]["gate_up"], ["blk.0.ffn_gate", "blk.0.ffn_up"]),
             (engine.layers[1]["qkv"], ["blk.1.attn_q", "blk.1.attn_k", "blk.1.attn_v"])]
    for weight, names in pairs:
        assert isinstance(weight, BlockWeight), names
        expected = torch.cat([torch.from_numpy(gguf.quants.dequantize(tensors[f"{n}.weight"].data,
                                                                      tensors[f"{n}.weight"].tensor_type).copy())
                              for n in names])
        assert torch.equal(weight.dequantize(), expected), names


def test_rotary_tables_grow_with_the_positions_and_keep_their_bits(engine):
    """On the CPU a rotary table covers the positions used so far, in whole
    chunks, and a position's rotation has the same bits whether the table grew
    step by step or at once; the angles are position * base^(-2j/d)."""
    assert 3072 < engine.config.context
    saved = engine.rotations
    try:
        engine.rotations = {}
        engine._rotations(torch.tensor([[3]]))
        assert {t.shape[0] for t in engine.rotations.values()} == {1024}
        engine._rotations(torch.tensor([[2999, 5]]))
        assert {t.shape[0] for t in engine.rotations.values()} == {3072}
        grown = dict(engine.rotations)
        engine.rotations = {}
        engine._cover_positions(3072)
        assert all(torch.equal(grown[base], engine.rotations[base]) for base in grown)
        c = engine.config
        base = c.rope_base_of(0)
        angles = torch.arange(3072, dtype=torch.float64)[:, None] * base ** (
            -torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        torch.testing.assert_close(grown[base].to(torch.complex128), torch.polar(torch.ones_like(angles), angles),
                                   rtol=0, atol=3e-4)  # float32 angles of positions up to 3K
    finally:
        engine.rotations = saved


def test_the_cache_loads_the_tokenizer_without_transformers_and_as_transformers_would(engine, tmp_path):
    """A tokenizer transformers saved as its generic tokenizers-backed class loads as
    fusedattn.tokenizer.SavedTokenizer, and it is AutoTokenizer's tokenizer of the same folder:
    ids, text, chat template renderings and special tokens; another class, or a configuration it
    does not reproduce, goes to transformers."""
    import json

    from transformers import AutoTokenizer

    from fusedattn.engine_cache import _load_tokenizer
    from fusedattn.tokenizer import SavedTokenizer

    folder = tmp_path / "tokenizer"
    engine.tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") != "TokenizersBackend":
        pytest.skip("transformers 4.x saves each tokenizer's own class: AutoTokenizer loads it")
    ours, theirs = _load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, SavedTokenizer)
    texts = ["Hi there", "", "  two  spaces\n\nand lines\t", "<|im_start|>user\nWhat is the capital of France? "
             "Paris, ünïcödé 🙂<|im_end|>", "<|endoftext|>x<|im_end|>", "1234567 + 0.5e-3 = ?"]
    for text in texts:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    conversations = [[{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? ünï"}]]
    for messages in conversations:
        for prompt in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False) == (
                theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False))
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "eos_token", "pad_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.convert_tokens_to_ids(["<|im_end|>", "no-such-token"]) == (
        theirs.convert_tokens_to_ids(["<|im_end|>", "no-such-token"]))
    again = tmp_path / "again"
    ours.save_pretrained(again)
    assert isinstance(_load_tokenizer(str(again)), SavedTokenizer)
    assert _load_tokenizer(str(again)).encode(texts[3]) == theirs.encode(texts[3])
    for change in ({"tokenizer_class": "GemmaTokenizer"}, {"add_bos_token": True},
                   {"clean_up_tokenization_spaces": True}):
        (again / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert not isinstance(_load_tokenizer(str(again)), SavedTokenizer), change
    (again / "tokenizer_config.json").unlink()  # tokenizer.json alone: through AutoTokenizer
    assert _load_tokenizer(str(again)).encode("Hi there") == theirs.encode("Hi there")



def test_the_saved_tokenizer_matches_transformers_on_templates_and_special_tokens(engine, tmp_path):
    """Beyond SmolLM2's own files: a template using the sandbox's globals and filters, a
    post-processor that adds a BOS token, conversations it hands to transformers (extra keys,
    None content, empty, tokenize=True), a namespace attribute the sandbox refuses, and folders
    it must leave to transformers (truncation or padding set, a special token not marked
    special, one given as a dict, the older special-token files)."""
    import json

    import jinja2
    from transformers import AutoTokenizer

    from fusedattn.tokenizer import SavedTokenizer, load

    folder = tmp_path / "tokenizer"
    engine.tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") != "TokenizersBackend":
        pytest.skip("transformers 4.x saves each tokenizer's own class: AutoTokenizer loads it")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                                  "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "chat_template.jinja").write_text(
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'bad' %}"
        "{{ raise_exception('no bad roles') }}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ bos_token }}{{ m.role }}:{% generation %}{{ m.content | tojson }}"
        "{% endgeneration %}{{ eos_token }}\n{% endfor %}{{ dict(a=1) | tojson }} {{ ns.n }}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    ours, theirs = load(str(folder)), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, SavedTokenizer)
    for special in (True, False):
        assert ours.encode("Hi there", add_special_tokens=special) == theirs.encode("Hi there",
                                                                                  add_special_tokens=special)
    assert ours.encode("Hi", add_special_tokens=True)[0] == 1 != ours.encode("Hi", add_special_tokens=False)[0]
    talk = [{"role": r, "content": f'say "{r}" ünï'} for r in ("system", "user", "assistant", "user", "user")]
    for prompt in (True, False):
        assert ours.apply_chat_template(talk, add_generation_prompt=prompt, tokenize=False) == (
            theirs.apply_chat_template(talk, add_generation_prompt=prompt, tokenize=False))
    for bad in ([{"role": "bad", "content": "x"}], [{"role": "user", "content": "x", "name": "y"}],
                [{"role": "user", "content": None}], []):
        try:
            expected = theirs.apply_chat_template(bad, tokenize=False)
        except Exception as e:  # the same error, from the same place
            with pytest.raises(type(e)):
                ours.apply_chat_template(bad, tokenize=False)
        else:
            assert ours.apply_chat_template(bad, tokenize=False) == expected
    assert ours.apply_chat_template(talk) == theirs.apply_chat_template(talk)  # tokenize=True
    (folder / "chat_template.jinja").write_text("{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        load(str(folder)).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)

    def refused(edit_spec=None, edit_config=None, extra_file=None):
        case = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        engine.tokenizer.save_pretrained(case)
        s, c = json.loads((case / "tokenizer.json").read_text()), dict(config)
        if edit_spec:
            edit_spec(s)
        if edit_config:
            edit_config(c)
        (case / "tokenizer.json").write_text(json.dumps(s))
        (case / "tokenizer_config.json").write_text(json.dumps(c))
        if extra_file:
            (case / extra_file).write_text("{}")
        return load(str(case)) is None

    def unmark(s):
        for t in s["added_tokens"]:
            if t["content"] == config["eos_token"]:
                t["special"] = False

    assert not refused()
    assert refused(edit_spec=lambda s: s.update(truncation={"direction": "Right", "max_length": 5, "strategy":
                                                            "LongestFirst", "stride": 0}))
    assert refused(edit_spec=lambda s: s.update(padding={"strategy": "BatchLongest", "direction": "Right",
                                                         "pad_to_multiple_of": None, "pad_id": 2, "pad_type_id": 0,
                                                         "pad_token": "<|im_end|>"}))
    assert refused(edit_spec=unmark)
    assert refused(edit_config=lambda c: c.update(pad_token="<pad>"))  # not in the vocabulary
    assert refused(edit_config=lambda c: c.update(eos_token={"__type": "AddedToken", "content": "<|im_end|>"}))
    assert refused(extra_file="special_tokens_map.json") and refused(extra_file="added_tokens.json")
