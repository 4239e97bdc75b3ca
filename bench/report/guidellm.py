"""Report section: guidellm's figures over HTTP beside pdserve's own client's over gRPC, for the same load."""
from __future__ import annotations

from .format import _div, _ms, _table, _x


def guidellm_section(res: dict) -> list[str]:
    g = res.get("guidellm")
    if not g or not g["cells"]:
        return []
    L = ["## guidellm (an outside client) against pdserve's own", ""]
    L += [f"guidellm {g['version']} runs against the gateway's OpenAI `/v1/completions` (streaming, `ignore_eos`, "
          "`max_tokens` as below) with its synthetic dataset: prompts of a fixed token count in the checkpoint's own "
          "tokenizer, a closed loop of *concurrency* streams. Right after each, on the same stack, pdserve's own "
          "bench client sends the same load (seeded token-id prompts of the same length, the same output tokens, "
          "concurrency and request count) over the gateway's gRPC API. The gap between the two is the HTTP front "
          "and the client: guidellm's TTFT counts from its HTTP send to the first streamed text, so a token held "
          "back for an unfinished UTF-8 character arrives later there. *ITL* here is guidellm's: each request's "
          "mean gap, (last token − first) / (tokens − 1), taken the same way from pdserve's client (the tables "
          "above take every gap). *tokens per request*: what guidellm counted (prompt / output), to show the "
          "load matched. guidellm's worker processes share the machine's cores with the stack, where pdserve's "
          "client is one lighter process: on 2 cores part of the gap is the client's own CPU.", ""]
    rows = []
    for c in g["cells"]:
        gl, pd = c["guidellm"], c["pdserve"]
        errors = f"{gl['errored']} + {gl['incomplete']} incomplete" if gl["incomplete"] else gl["errored"]
        rows.append([c["preset"], c["prompt_len"], c["concurrency"], c["num_requests"], "guidellm (HTTP)",
                     _ms(gl["ttft_p50"]), _ms(gl["ttft_p99"]), _ms(gl["itl_p50"]), _ms(gl["itl_p99"]),
                     f"{gl['out_tok_s']:.0f}", f"{gl['req_s']:.2f}", errors,
                     f"{gl['prompt_tokens_p50']:.0f} / {gl['output_tokens_p50']:.0f}", _x(_div(gl["out_tok_s"],
                                                                                            pd["out_tok_s"]))])
        rows.append([c["preset"], c["prompt_len"], c["concurrency"], pd["num_requests"], "pdserve client (gRPC)",
                     _ms(pd["ttft_p50"]), _ms(pd["ttft_p99"]), _ms(pd["extra"]["itl_req_p50"]),
                     _ms(pd["extra"]["itl_req_p99"]),
                     f"{pd['out_tok_s']:.0f}", f"{pd['req_s']:.2f}", pd["num_errors"],
                     f"{c['prompt_len']} / {res['max_tokens']}", "1.00×"])
    L += _table(["preset", "prompt", "conc", "n", "client", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                 "out tok/s", "req/s", "errors", "tokens per request", "tok/s vs pdserve client"], rows)
    L += ["guidellm's own output: " + ", ".join(f"`{p}`" for p in sorted({c["output"] for c in g["cells"]})), ""]
    return L
