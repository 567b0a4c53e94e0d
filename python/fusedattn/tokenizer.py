"""A tokenizer that transformers saved as its generic tokenizers-backed class
(``TokenizersBackend``: tokenizer.json, tokenizer_config.json and, with a chat
template, chat_template.jinja), loaded with the ``tokenizers`` library and
jinja2 alone. Importing transformers costs a command's start about 0.5 s on a
small CPU; the engine's cached models (engine_cache) load this instead.

It gives what the engine and its server use of transformers' tokenizer, with
the same results (tests/test_tokenizer.py compares them): ``encode``,
``decode``, ``apply_chat_template`` of {role, content} messages, the special
tokens' ids and ``save_pretrained``. ``load`` answers None for a folder whose
configuration asks for anything more, and the caller goes to transformers.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime

_CONFIG, _TOKENIZER, _TEMPLATE = "tokenizer_config.json", "tokenizer.json", "chat_template.jinja"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
# The configuration keys whose meaning this class reproduces; any other key
# (a normaliser flag, an added BOS, cleaning up spaces) sends the folder to
# transformers.
_UNDERSTOOD = {"backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length",
               "clean_up_tokenization_spaces", *_SPECIAL}


class SavedTokenizer:
    """The tokenizer in ``folder``, as transformers' TokenizersBackend reads it."""

    def __init__(self, folder: str, config: dict):
        from tokenizers import Tokenizer

        self.folder = folder
        self._tokenizer = Tokenizer.from_file(os.path.join(folder, _TOKENIZER))
        self._special = {name: config[name] for name in _SPECIAL if isinstance(config.get(name), str)}
        template = os.path.join(folder, _TEMPLATE)
        self.chat_template = None
        if os.path.exists(template):
            with open(template, encoding="utf-8") as f:
                self.chat_template = f.read()
        self._compiled = None

    def __getattr__(self, name: str):
        # bos_token_id, eos_token_id, unk_token_id, pad_token_id, mask_token_id
        # and the tokens themselves: None where the configuration names none.
        if name.endswith("_token_id") and name[:-3] in _SPECIAL:
            token = self._special.get(name[:-3])
            return None if token is None else self._tokenizer.token_to_id(token)
        if name in _SPECIAL:
            return self._special.get(name)
        raise AttributeError(name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens):
        """A token's id, or (absent) the unknown token's; a list maps each."""
        if isinstance(tokens, str):
            found = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True):
        """The conversation rendered by the model's template as transformers
        renders it (jinja2's sandbox, blocks trimmed, loop controls,
        raise_exception, strftime_now, tojson); its ids where tokenize."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        text = self._compiled.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._special)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        for name in (_CONFIG, _TOKENIZER, _TEMPLATE):
            source = os.path.join(self.folder, name)
            if os.path.exists(source):
                shutil.copyfile(source, os.path.join(folder, name))


def load(folder: str) -> SavedTokenizer | None:
    """The tokenizer transformers saved in folder as TokenizersBackend, or None
    where it saved another class or a configuration this class does not
    reproduce."""
    try:
        with open(os.path.join(folder, _CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return None
    if (config.get("tokenizer_class") != "TokenizersBackend" or set(config) - _UNDERSTOOD
            or config.get("clean_up_tokenization_spaces", False) or config.get("backend", "tokenizers") != "tokenizers"
            or not os.path.exists(os.path.join(folder, _TOKENIZER))):
        return None
    return SavedTokenizer(folder, config)


def _compile(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: transformers marks the
        assistant's tokens with it; rendered, it is its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
