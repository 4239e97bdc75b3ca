"""The tokenizer files `pdserve make-model` writes beside a random checkpoint: a byte-level BPE trained on a small
built-in corpus, so generated ids decode to word pieces."""
from __future__ import annotations

import os

VOCAB_SIZE = 512
BOS, EOS = "<s>", "</s>"

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


def write_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
