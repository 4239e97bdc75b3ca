"""Through the running services, prompts of 1 to 1,000 tokens, 16 at a time, pass the reference oracle."""
import random
from concurrent.futures import ThreadPoolExecutor


PAGE = 16
LENGTHS = sorted({1, 2, 3, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE - 1, 2 * PAGE, 2 * PAGE + 1, 63, 64, 65, 100, 127, 128,
                  129, 255, 256, 257, 300, 333, 400, 499, 500, 511, 512, 513, 600, 640, 700, 767, 768, 769, 800,
                  850, 900, 959, 960, 961, 990, 999, 1000, 7, 42, 77, 150, 200, 222, 450, 555, 620, 880, 1000 - 17})


def _prompt(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(2, 512) for _ in range(n)]


def test_fifty_plus_prompts_sixteen_at_a_time_pass_oracle(stack, oracle):
    assert len(LENGTHS) >= 50
    jobs = [(n, _prompt(n, n), 6 + n % 11) for n in LENGTHS]

    def run(job):
        n, prompt, max_tokens = job
        return stack.generate(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    for (n, prompt, max_tokens), out in zip(jobs, results):
        assert "error" not in out, (n, out)
        assert out["prompt_tokens"] == n
        assert len(out["token_ids"]) == max_tokens and out["finish_reason"] == "length"
        oracle.check(prompt, out["token_ids"])


def test_text_prompt_streams_and_passes_oracle(stack, oracle):
    from pdserve.engine.tokenizer import load_tokenizer
    tok = load_tokenizer(oracle.model_dir, 512)
    out = stack.generate(prompt="hello, the quick brown fox", max_tokens=24, ignore_eos=True)
    assert "error" not in out, out
    prompt = tok.encode("hello, the quick brown fox")
    assert out["prompt_tokens"] == len(prompt)
    oracle.check(prompt, out["token_ids"])
    assert out["text"] == tok.decode(out["token_ids"])


def test_eos_stops_generation(stack, oracle):
    """A prompt whose reference continuation is the end-of-sequence token stops there (finish 'stop'),
    and the same prompt with ignore_eos keeps going. The prompt is found with the reference engine."""
    import torch
    base = _prompt(29, 4242)
    candidates = torch.tensor([base + [t] for t in range(2, 512)])
    with torch.inference_mode():
        last = oracle.hf(candidates).logits[:, -1]  # one batched forward over all 510 candidates
    eos_prompts = [candidates[i].tolist() for i in torch.nonzero(last.argmax(-1) == 1).flatten().tolist()]
    assert eos_prompts, "no single-token continuation of the base prompt leads to EOS"
    prompt = eos_prompts[0]
    out = stack.generate(prompt_token_ids=prompt, max_tokens=20)
    assert out["token_ids"] == [1] and out["finish_reason"] == "stop", out
    out = stack.generate(prompt_token_ids=prompt, max_tokens=20, ignore_eos=True)
    assert len(out["token_ids"]) == 20 and out["token_ids"][0] == 1 and out["finish_reason"] == "length"
    oracle.check(prompt, out["token_ids"])


def test_seeded_sampling_is_reproducible(stack):
    prompt = _prompt(50, 3)
    a = stack.generate(prompt_token_ids=prompt, max_tokens=20, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    b = stack.generate(prompt_token_ids=prompt, max_tokens=20, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    c = stack.generate(prompt_token_ids=prompt, max_tokens=20, temperature=0.9, top_p=0.9, seed=12, ignore_eos=True)
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]
