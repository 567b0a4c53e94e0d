"""A tokenizer that transformers saved as its generic tokenizers-backed class
(``TokenizersBackend``: tokenizer.json, tokenizer_config.json and, with a chat
template, chat_template.jinja), loaded with the ``tokenizers`` library and
jinja2 alone. Importing transformers costs a command's start about 0.5 s on a
small CPU; the engine's cached models (engine_cache) load this instead.

It gives what the engine and its server use of transformers' tokenizer, with
the same results (tests/test_engine.py compares them): ``encode``, ``decode``,
``apply_chat_template`` of {role, content} string messages rendered to text,
the special tokens' ids and ``save_pretrained``. Any other conversation, or
tokenize=True, goes to transformers' tokenizer of the same folder, loaded then.
``load`` answers None for a folder it would not read as transformers does
(truncation or padding set, special tokens it does not mark as special, the
older special-token files, a configuration key it does not know, jinja2 older
than 3.1.6, whose sandbox has known escapes), and the caller goes to
transformers.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime

_CONFIG, _TOKENIZER, _TEMPLATE = "tokenizer_config.json", "tokenizer.json", "chat_template.jinja"
_OLDER_FILES = ("special_tokens_map.json", "added_tokens.json")  # transformers reads them; this class does not
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
# The configuration keys whose meaning this class reproduces; any other key
# (a normaliser flag, an added BOS, cleaning up spaces) sends the folder to
# transformers.
_UNDERSTOOD = {"backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length",
               "clean_up_tokenization_spaces", *_SPECIAL}


class SavedTokenizer:
    """The tokenizer in ``folder``, as transformers' TokenizersBackend reads it."""

    def __init__(self, folder: str, config: dict, tokenizer):
        self.folder = folder
        self._tokenizer = tokenizer  # tokenizers.Tokenizer of folder's tokenizer.json
        self._special = {name: config[name] for name in _SPECIAL if isinstance(config.get(name), str)}
        template = os.path.join(folder, _TEMPLATE)
        self.chat_template = None
        if os.path.exists(template):
            with open(template, encoding="utf-8") as f:
                self.chat_template = f.read()
        self._compiled = None
        self._transformers = None

    def __getattr__(self, name: str):
        # bos_token_id, eos_token_id, unk_token_id, pad_token_id, mask_token_id
        # and the tokens themselves: None where the configuration names none.
        if name.endswith("_token_id") and name[:-3] in _SPECIAL:
            token = self._special.get(name[:-3])
            return None if token is None else self._tokenizer.token_to_id(token)
        if name in _SPECIAL:
            return self._special.get(name)
        raise AttributeError(name)

    @property
    def backend_tokenizer(self):
        """The tokenizers.Tokenizer, as transformers' fast tokenizers name theirs."""
        return self._tokenizer

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
        raise_exception, strftime_now, tojson, guarded dict and namespace).
        Messages other than {role, content} strings, an empty conversation or
        tokenize=True: transformers' own apply_chat_template."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        plain = bool(messages) and all(
            type(m) is dict and set(m) == {"role", "content"} and all(type(x) is str for x in m.values())
            for m in messages)
        if not plain or tokenize:
            return self._transformers_tokenizer().apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize)
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        return self._compiled.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._special)

    def _transformers_tokenizer(self):
        if self._transformers is None:
            from transformers import AutoTokenizer

            self._transformers = AutoTokenizer.from_pretrained(self.folder)
        return self._transformers

    def save_pretrained(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        for name in (_CONFIG, _TOKENIZER, _TEMPLATE):
            source = os.path.join(self.folder, name)
            if os.path.exists(source):
                shutil.copyfile(source, os.path.join(folder, name))


def load(folder: str) -> SavedTokenizer | None:
    """The tokenizer transformers saved in folder as TokenizersBackend, or None
    where it saved another class or anything this class would read otherwise
    than transformers does (the module's docstring lists what)."""
    try:
        with open(os.path.join(folder, _CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return None
    if (config.get("tokenizer_class") != "TokenizersBackend" or set(config) - _UNDERSTOOD
            or config.get("clean_up_tokenization_spaces", False) or config.get("backend", "tokenizers") != "tokenizers"
            or any(os.path.exists(os.path.join(folder, name)) for name in _OLDER_FILES)
            or not os.path.exists(os.path.join(folder, _TOKENIZER)) or not _sandbox_is_safe()):
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(folder, _TOKENIZER))  # parsed once, checked and kept
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    named = [config.get(name) for name in _SPECIAL]
    if (tokenizer.truncation is not None or tokenizer.padding is not None
            or any(t is not None and (type(t) is not str or t not in special) for t in named)):
        return None
    return SavedTokenizer(folder, config, tokenizer)


def _sandbox_is_safe() -> bool:
    import jinja2

    return tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) >= (3, 1, 6)


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

    class GuardedNamespace(jinja2.utils.Namespace):
        """namespace() that takes no name starting with an underscore (a way
        to CPython's internals from a template)."""

        def __init__(*args, **kwargs):  # no named self: namespace(self=1) must work as in jinja2
            names = dict(*args[1:], **kwargs)
            for name in names:
                GuardedNamespace.check(name)
            jinja2.utils.Namespace.__init__(args[0], names)

        def __setitem__(self, name, value):
            GuardedNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class PlainDict:
        """dict() and dict.fromkeys() for templates, without the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=PlainDict(), namespace=GuardedNamespace)
    return env.from_string(template)
