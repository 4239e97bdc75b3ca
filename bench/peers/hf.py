"""The transformers baseline: LlamaForCausalLM.generate on the same checkpoint, one request at a time."""
from __future__ import annotations

import time

import torch

from ..harness.workload import Record


class _Clock:
    """A generate() streamer that only timestamps tokens: put() gets the prompt first, then each new token."""

    def __init__(self, record: Record):
        self.record = record
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        now = time.perf_counter()
        for tok in value.reshape(-1).tolist():
            self.record.token_ids.append(int(tok))
            self.record.token_times.append(now)

    def end(self) -> None:
        pass


class HFBaseline:
    def __init__(self, model_dir: str, device: str = "cpu"):
        from transformers import LlamaForCausalLM

        self.device = device
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
        self.vocab_size = self.model.config.vocab_size

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[Record], float]:
        """Serial: each request starts when the previous one ends (concurrency 1 by construction)."""
        records = []
        start = time.perf_counter()
        for p in prompts:
            rec = Record(time.perf_counter())
            ids = torch.tensor([p], dtype=torch.int64, device=self.device)
            # min_new_tokens = max_new_tokens is transformers' way to ignore EOS
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, streamer=_Clock(rec),
                                pad_token_id=self.model.config.eos_token_id)
            records.append(rec)
        return records, time.perf_counter() - start
