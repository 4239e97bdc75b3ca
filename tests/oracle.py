"""The reference oracle (DESIGN §7): teacher forcing over prompt + response in one forward pass.

Each greedy response token must be the reference's arg-max at its position, or within 1e-3 of the
maximum logit (float ties). Stale or foreign KV moves logits far beyond that, so this never flakes.
Two independent references: the engine without services, and Hugging Face `transformers`. At long lengths
(LongOracle) transformers alone, with SDPA attention: its memory grows with the length, not with its square.
"""
from __future__ import annotations

import threading

import torch

TOLERANCE = 1e-3


class OracleMismatch(AssertionError):
    pass


def check_teacher_forced(logits: torch.Tensor, prompt: list[int], response: list[int], who: str) -> None:
    # logits: [len(prompt) + len(response), V]; row i predicts token i + 1
    check_response_rows(logits[len(prompt) - 1:len(prompt) - 1 + len(response)], len(prompt), response, who)


def check_response_rows(rows: torch.Tensor, num_prompt: int, response: list[int], who: str) -> float:
    """rows: [len(response), V], row j the reference's logits for response token j. Returns the largest shortfall
    of a served token under its row's maximum."""
    if rows.shape[0] != len(response):
        raise OracleMismatch(f"{who}: {rows.shape[0]} reference rows for {len(response)} response tokens")
    worst = 0.0
    for j, tok in enumerate(response):
        row = rows[j]
        best = float(row.max())
        if int(row.argmax()) != tok and float(row[tok]) < best - TOLERANCE:
            raise OracleMismatch(
                f"{who}: response token {j} is {tok} (logit {float(row[tok]):.4f}) but the reference arg-max is "
                f"{int(row.argmax())} (logit {best:.4f}); prompt {num_prompt} tokens")
        worst = max(worst, best - float(row[tok]))
    return worst


def check_served_logprobs(rows: torch.Tensor, response: list[int], served: list[float], who: str) -> float:
    """The log-probability served with each token against the reference's, within TOLERANCE: stricter than the
    arg-max rule, it also sees KV that moved the logits without changing which token wins. Returns the largest
    difference."""
    if len(served) != len(response):
        raise OracleMismatch(f"{who}: {len(served)} served logprobs for {len(response)} response tokens")
    ref = torch.log_softmax(rows.double(), -1)[torch.arange(len(response)), torch.tensor(response)].tolist()
    diffs = [abs(a - b) for a, b in zip(served, ref)]
    j = max(range(len(diffs)), key=diffs.__getitem__, default=0)
    if diffs and diffs[j] > TOLERANCE:
        raise OracleMismatch(f"{who}: the logprob served with response token {j} ({response[j]}) is {served[j]:.5f}, "
                             f"the reference's {ref[j]:.5f} ({diffs[j]:.2e} apart, tolerance {TOLERANCE})")
    return max(diffs, default=0.0)


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


class LongOracle:
    """Teacher forcing at lengths where a [T, T] score matrix does not fit: transformers' LlamaForCausalLM in
    float32 with SDPA attention, which on a causal pass without padding builds no mask and no score matrix (its
    peak memory grows linearly with the length: ~600 MiB above the loaded model at 32,768 tokens, measured by
    bench/scenarios/long_prompt.py, where eager attention's scores alone are 32 GiB a layer).
    The prompt runs once into a KV cache (`prompt_state`, which a test may start while the stack serves), the
    response through that cache; only the rows checked are projected onto the vocabulary. Independent of the
    serving path: no pdserve code runs here."""

    def __init__(self, model_dir: str):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                      attn_implementation="sdpa").eval()
        self._lock = threading.Lock()

    @torch.inference_mode()
    def prompt_state(self, prompt: list[int]):
        """(KV cache of the prompt, [1, V] logits of its last row, the prompt). One use: rows() extends the cache."""
        from transformers import DynamicCache

        cache = DynamicCache()
        with self._lock:
            out = self.model(torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[0].float(), list(prompt)

    @torch.inference_mode()
    def rows(self, prompt: list[int], response: list[int], state=None) -> torch.Tensor:
        """[len(response), V]: row j predicts response token j, as one pass over prompt + response would."""
        cache, last, seen = state if state is not None else self.prompt_state(prompt)
        if seen != list(prompt) or cache.get_seq_length() != len(prompt):
            raise ValueError(f"a prompt state of {len(seen)} tokens, {cache.get_seq_length()} cached, does not belong "
                             f"to this {len(prompt)}-token prompt (or was used before)")
        if len(response) < 2:
            return last[:len(response)]
        with self._lock:
            out = self.model(torch.tensor([list(response[:-1])]), cache=cache, use_cache=True)
        return torch.cat([last, out.logits[0].float()])

    def check(self, prompt: list[int], response: list[int], state=None) -> float:
        """Raises OracleMismatch unless every response token passes; returns the largest shortfall."""
        if not response:
            raise OracleMismatch("empty response")
        return check_response_rows(self.rows(prompt, response, state), len(prompt), response,
                                   "transformers SDPA reference")
