"""Chat templates: the jinja2 template a checkpoint ships, rendered as `transformers`' `apply_chat_template` renders
it, so a chat request reaches the model as the same text it was trained on.

Templates come from the Hub and are untrusted code: they run in jinja2's immutable sandbox."""
from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The token names transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES); other `*_token` keys of
# tokenizer_config.json are model-specific tokens, passed too.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refuses a conversation (`raise_exception`, a bad role order)."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, which would reach CPython internals from inside the sandbox."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the `dict` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_Dict(), namespace=_Namespace)
    return env


def _token_text(name: str, value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]  # an AddedToken written as a dict
    raise ChatTemplateError(f"tokenizer_config.json: {name} must be a string or an AddedToken dict, got {value!r}")


def _read_templates(model_dir: str, config: dict) -> dict[str, str]:
    """Named templates; separate .jinja files win over tokenizer_config.json, as in transformers."""
    templates = {}
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            templates["default"] = f.read()
    extra_dir = os.path.join(model_dir, "chat_templates")
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                    templates[name.removesuffix(".jinja")] = f.read()
    if templates:
        return templates
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ChatTemplateError(f"tokenizer_config.json: chat_template must be a string or a list of "
                            f"{{name, template}} objects, got {type(value).__name__}")


class ChatTemplate:
    """A checkpoint's chat template(s) and the special tokens its template may name (`bos_token`, ...)."""

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str]):
        if "default" not in templates:
            raise ChatTemplateError(f"the checkpoint has {len(templates)} named chat templates "
                                    f"({', '.join(sorted(templates))}) and none is named 'default'")
        env = _environment()
        try:
            self._compiled = {name: env.from_string(text) for name, text in templates.items()}
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self.special_tokens = special_tokens
        self.sources = dict(templates)  # the text, for what a template teaches (the gateway's tool-call format)

    @classmethod
    def from_dir(cls, model_dir: str) -> ChatTemplate | None:
        """The template of a checkpoint directory, or None when it ships none."""
        config = {}
        path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise ChatTemplateError(f"{path} is not valid JSON: {e}") from e
            if not isinstance(config, dict):
                raise ChatTemplateError(f"{path} is not a JSON object")
        templates = _read_templates(model_dir, config)
        if not templates:
            return None
        special = {k: _token_text(k, v) for k, v in config.items() if k in _SPECIAL_TOKENS and v is not None}
        special.update({k: _token_text(k, v) for k, v in config.items()  # add_bos_token and its like are flags
                        if k not in special and k.endswith("_token") and isinstance(v, (str, dict))})
        return cls(templates, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               **kwargs) -> str:
        """The prompt text; extra keyword arguments reach the template as variables (e.g. `enable_thinking`)."""
        if not isinstance(messages, list):
            raise ChatTemplateError(f"messages must be a list, got {type(messages).__name__}")
        if not messages:
            raise ChatTemplateError("a chat needs at least one message (got 0)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ChatTemplateError(f"message {i} is a {type(m).__name__}, not an object")
        # keys set to None (OpenAI's content=None) are dropped: templates test for a missing key, not for None
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        template = self._compiled["tool_use" if tools is not None and "tool_use" in self._compiled else "default"]
        variables = {**self.special_tokens, "documents": None, **kwargs}
        try:
            return template.render(messages=chat, tools=tools, add_generation_prompt=add_generation_prompt,
                                   **variables)
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as e:
            raise ChatTemplateError(f"chat template refused the conversation: {e}") from e
