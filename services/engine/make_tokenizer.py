"""The tokenizer files `pdserve make-model` writes beside a random checkpoint: a byte-level BPE trained on a small
built-in corpus, so generated ids decode to word pieces, and the config files (special tokens, chat template) that
`transformers.AutoTokenizer` and clients built on it, such as guidellm, read."""
from __future__ import annotations

import json
import os

VOCAB_SIZE = 512
BOS, EOS = "<s>", "</s>"

# ChatML's layout with the tokenizer's own specials as turn markers: each turn is one id at each end, and the
# assistant's turn ends on EOS, the id generation stops at. Content given as a list of parts renders its text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token }}{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}"
    "{% endif %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)

# Training text for the byte-level BPE tokenizer, so generated ids decode to word pieces.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A disaggregated server runs prefill and decode on
separate machines and moves the key value cache between them. Every page has an owner, an epoch and
a generation; a page whose tag does not match its lease is never read. Hello world, hello there,
how are you today? The weather is fine and the river runs to the sea. Numbers one two three four
five six seven eight nine ten. Once upon a time there was a small model that answered questions
about the stars, the moon and the long road home. Requests arrive, wait in a queue, and leave with
their answers; nothing is lost and nothing is shared between users.
"""


def write_tokenizer(out: str, model_max_length: int = 4096) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    _write_config(out, model_max_length, {text: tok.token_to_id(text) for text in (BOS, EOS)})


def _write_config(out: str, model_max_length: int, special_ids: dict[str, int]) -> None:
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}
    added = {str(i): dict(content=text, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
             for text, i in special_ids.items()}
    config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=model_max_length,
                  clean_up_tokenization_spaces=False, added_tokens_decoder=added, **specials,
                  chat_template=CHAT_TEMPLATE)
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", specials)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
