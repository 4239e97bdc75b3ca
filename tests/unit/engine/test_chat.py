"""Chat templates: pdserve's rendering (text and token ids) equals transformers' apply_chat_template for the same
tokenizer files: the tiny model's own, and real-world templates written into tokenizer_config.json."""
import json
import os
import shutil

import pytest
from transformers import AutoTokenizer

from pdserve.engine.chat import ChatTemplate, ChatTemplateError
from pdserve.engine.make_tokenizer import BOS, EOS, write_tokenizer
from pdserve.engine.tokenizer import HFTokenizer

from .chat_templates import CONTROLS, LLAMA3, MISTRAL, QWEN25

SYSTEM = {"role": "system", "content": "  Be brief & kind <b>.  "}
USER1 = {"role": "user", "content": "Hello there, how are you today?"}
ASSISTANT = {"role": "assistant", "content": "The river runs to the sea."}
USER2 = {"role": "user", "content": "Grüße — once upon a time 🙂"}
CHATS = {"one": [USER1], "multi": [USER1, ASSISTANT, USER2], "system": [SYSTEM, USER1, ASSISTANT, USER2]}
TOOL_CALL = {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Nice"}}}]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather <today>",
                                           "parameters": {"type": "object", "properties": {"city": {}}}}}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("chat") / "tiny")
    os.makedirs(out)
    write_tokenizer(out)
    return out


@pytest.fixture
def with_template(tok_dir, tmp_path):
    """A checkpoint directory with the tiny tokenizer.json and the given tokenizer_config.json fields."""
    def make(**config):
        shutil.copy(os.path.join(tok_dir, "tokenizer.json"), tmp_path)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, **config}
        with open(tmp_path / "tokenizer_config.json", "w") as f:
            json.dump(config, f)
        return str(tmp_path)
    return make


def assert_same(model_dir, messages, add_generation_prompt, **kwargs):
    """The text and its ids through pdserve's tokenizer equal transformers' rendering and tokenization."""
    hf = AutoTokenizer.from_pretrained(model_dir)
    ours = ChatTemplate.from_dir(model_dir).render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours == hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                          **kwargs)
    ids = HFTokenizer(os.path.join(model_dir, "tokenizer.json")).encode(ours)
    assert ids == hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                         return_dict=False, **kwargs)
    return ours, ids


def test_tiny_tokenizer_loads_in_transformers(tok_dir):
    hf = AutoTokenizer.from_pretrained(tok_dir)
    assert (hf.bos_token, hf.bos_token_id, hf.eos_token, hf.eos_token_id, hf.pad_token_id) == (BOS, 0, EOS, 1, 1)
    assert hf.model_max_length == 4096
    ours = HFTokenizer(os.path.join(tok_dir, "tokenizer.json"))
    text = "The quick brown fox, naïve 🙂"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf.decode(ours.encode(text)) == text
    with open(os.path.join(tok_dir, "special_tokens_map.json")) as f:
        assert json.load(f) == {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tiny_template(tok_dir, chat, add_generation_prompt):
    text, ids = assert_same(tok_dir, CHATS[chat], add_generation_prompt)
    # every turn is framed by the special ids themselves (BOS 0, EOS 1), not by their text spelled in bytes
    assert ids.count(0) == len(CHATS[chat]) + add_generation_prompt and ids.count(1) == len(CHATS[chat])
    assert text.endswith("<s>assistant\n") == add_generation_prompt


def test_tiny_template_content_parts(tok_dir):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "image_url", "image_url": {}},
                                          {"type": "text", "text": "world"}]}]
    text, _ = assert_same(tok_dir, parts, True)
    assert text == "<s>user\nhello world</s>\n<s>assistant\n"


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_world_templates(with_template, chat, add_generation_prompt):
    for template in (LLAMA3, QWEN25, MISTRAL if chat != "system" else CONTROLS):
        assert_same(with_template(chat_template=template), CHATS[chat], add_generation_prompt)


def test_qwen_default_system_prompt_and_tool_calls(with_template):
    model_dir = with_template(chat_template=QWEN25)
    text, _ = assert_same(model_dir, [USER1, TOOL_CALL, {"role": "tool", "content": "sunny"}], True)
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert '{"name": "weather", "arguments": {"city": "Nice"}}' in text and "None" not in text


def test_llama3_tools_and_variables(with_template):
    model_dir = with_template(chat_template=LLAMA3)
    text, _ = assert_same(model_dir, CHATS["system"], True, tools=TOOLS, date_string="26 Jul 2024")
    assert "Today Date: 26 Jul 2024" in text and '"description": "Weather <today>"' in text


def test_controls_template_kwargs(with_template):
    text, _ = assert_same(with_template(chat_template=CONTROLS), CHATS["system"], True, max_turns=1)
    assert text == f"    U1: {USER1['content']}\nA:"  # lstrip_blocks strips before tags only
    text, _ = assert_same(with_template(chat_template=CONTROLS), [USER1, TOOL_CALL], False)
    assert text.endswith(f"A2: {EOS}") and "None" not in text and "DOCUMENTS" not in text


def test_mistral_refuses_bad_role_order(with_template):
    model_dir = with_template(chat_template=MISTRAL)
    bad = [USER1, USER2]
    with pytest.raises(Exception) as hf_error:
        AutoTokenizer.from_pretrained(model_dir).apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="roles must alternate") as ours:
        ChatTemplate.from_dir(model_dir).render(bad)
    assert str(hf_error.value) in str(ours.value)
    assert isinstance(ours.value, ValueError)  # the HTTP server maps it to a 400


def test_named_templates_and_jinja_file(with_template):
    named = [{"name": "default", "template": MISTRAL}, {"name": "tool_use", "template": QWEN25}]
    model_dir = with_template(chat_template=named)
    assert_same(model_dir, CHATS["multi"], True)
    assert_same(model_dir, CHATS["multi"], True, tools=TOOLS)  # tools pick "tool_use", as in transformers
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(LLAMA3)  # newer transformers writes the template here; it wins over tokenizer_config.json
    text, _ = assert_same(model_dir, CHATS["multi"], True)
    assert "<|start_header_id|>" in text


def test_special_tokens_as_added_token_dicts(with_template):
    token = {"__type": "AddedToken", "content": EOS, "lstrip": False, "rstrip": False, "normalized": False}
    text, _ = assert_same(with_template(chat_template=MISTRAL, eos_token=token, add_bos_token=False),
                          CHATS["multi"], False)
    assert text.count(EOS) == 1


def test_no_template_is_none(with_template):
    assert ChatTemplate.from_dir(with_template()) is None


@pytest.mark.parametrize("config, match", [
    ({"chat_template": "{% for m in messages %}"}, "does not compile"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, r"1 named chat templates \(tool_use\)"),
    ({"chat_template": 7}, "must be a string or a list"),
    ({"chat_template": "x", "bos_token": 3}, "bos_token must be a string"),
])
def test_bad_checkpoints_refused(with_template, config, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate.from_dir(with_template(**config))


def test_broken_config_refused(with_template):
    model_dir = with_template(chat_template="x")
    with open(os.path.join(model_dir, "tokenizer_config.json"), "a") as f:
        f.write(",")
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json is not valid JSON: Extra data"):
        ChatTemplate.from_dir(model_dir)


@pytest.mark.parametrize("template, messages, match", [
    ("{{ ''.__class__.__mro__ }}", [USER1], "unsafe|access"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", [USER1], "_x"),
    ("{{ messages[0]['content'] + 1 }}", [USER1], "refused the conversation"),
    ("x", [], "at least one message"),
    ("x", ["hello"], "message 0 is a str"),
    ("x", {"role": "user"}, "must be a list, got dict"),
])
def test_bad_conversations_refused(with_template, template, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate.from_dir(with_template(chat_template=template)).render(messages)
