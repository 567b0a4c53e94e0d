"""The engine's greedy tokens against transformers' generate on the same model."""

import torch


def assert_greedy_matches(engine, model, prompts: list[list[int]], ours: list[list[int]], new_tokens: int) -> None:
    """ours[i] (the engine's new tokens for prompts[i]) equals transformers' greedy generate up to
    its first end-of-text (what follows it is not compared)."""
    eos = {engine.tokenizer.eos_token_id}
    for ids, mine in zip(prompts, ours):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):]
        theirs = theirs.tolist()
        end = next((i + 1 for i, t in enumerate(theirs) if t in eos), len(theirs))
        assert mine[:end] == theirs[:end], engine.tokenizer.decode(mine) + " | " + engine.tokenizer.decode(theirs)
