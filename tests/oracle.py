"""The reference oracle (DESIGN §7): teacher forcing over prompt + response in one forward pass.

Each greedy response token must be the reference's arg-max at its position, or within 1e-3 of the
maximum logit (float ties). Stale or foreign KV moves logits far beyond that, so this never flakes.
Two independent references: the engine without services, and Hugging Face `transformers`.
"""
from __future__ import annotations

import threading

import torch

TOLERANCE = 1e-3


class OracleMismatch(AssertionError):
    pass


def check_teacher_forced(logits: torch.Tensor, prompt: list[int], response: list[int], who: str) -> None:
    # logits: [len(prompt) + len(response), V]; row i predicts token i + 1
    for j, tok in enumerate(response):
        row = logits[len(prompt) - 1 + j]
        best = float(row.max())
        if int(row.argmax()) != tok and float(row[tok]) < best - TOLERANCE:
            raise OracleMismatch(
                f"{who}: response token {j} is {tok} (logit {float(row[tok]):.4f}) but the reference arg-max is "
                f"{int(row.argmax())} (logit {best:.4f}); prompt {len(prompt)} tokens")


class Oracle:
    def __init__(self, model_dir: str, max_tokens: int = 4096):
        from pdserve.engine.runner import ModelRunner

        self.model_dir = model_dir
        self.runner = ModelRunner(model_dir, num_pages=max_tokens // 16, page_size=16, device="cpu")
        self._hf = None
        self._lock = threading.Lock()

    @property
    def hf(self):
        if self._hf is None:
            from transformers import LlamaForCausalLM
            self._hf = LlamaForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        return self._hf

    def engine_logits(self, ids: list[int]) -> torch.Tensor:
        with self._lock:
            n = -(-len(ids) // 16)
            return self.runner.prefill(ids, list(range(n)), all_logits=True)

    @torch.inference_mode()
    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        with self._lock:
            return self.hf(torch.tensor([ids])).logits[0].float()

    @torch.inference_mode()
    def check_many(self, pairs: list[tuple[list[int], list[int]]], batch: int = 16) -> None:
        """Teacher forcing for many responses at once: right-padded batches through transformers (padding
        after a sequence cannot change the causal logits before it)."""
        for i in range(0, len(pairs), batch):
            chunk = pairs[i:i + batch]
            seqs = [list(p) + list(r) for p, r in chunk]
            width = max(len(x) for x in seqs)
            ids = torch.zeros((len(seqs), width), dtype=torch.int64)
            mask = torch.zeros((len(seqs), width), dtype=torch.int64)
            for j, x in enumerate(seqs):
                ids[j, :len(x)] = torch.tensor(x)
                mask[j, :len(x)] = 1
            with self._lock:
                logits = self.hf(ids, attention_mask=mask).logits.float()
            for j, (p, r) in enumerate(chunk):
                if not r:
                    raise OracleMismatch("empty response")
                check_teacher_forced(logits[j], p, r, "transformers reference (batched)")

    def check(self, prompt: list[int], response: list[int], use_hf: bool = True) -> None:
        if not response:
            raise OracleMismatch("empty response")
        ids = list(prompt) + list(response)
        check_teacher_forced(self.engine_logits(ids), prompt, response, "engine reference")
        if use_hf:
            check_teacher_forced(self.hf_logits(ids), prompt, response, "transformers reference")
