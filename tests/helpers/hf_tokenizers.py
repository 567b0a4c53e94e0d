"""Tokenizer set-up shared by the tests that compare against transformers."""


def pad_on_the_left(tokenizer):
    """Left padding for batched generation, with the end-of-text token as the
    pad token where the tokenizer has none (transformers releases before 5.2x
    read no pad token from SmolLM2's GGUF file: 5.17 on the H200 raised
    "Asking to pad but the tokenizer does not have a padding token")."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
