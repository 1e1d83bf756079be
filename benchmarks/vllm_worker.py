"""vLLM's side of ``benchmarks/vs_vllm.py``: one vLLM engine in vLLM's own environment, driven over
stdin/stdout (imports vLLM and the standard library only; never dspec).

    LD_PRELOAD=<vllm venv>/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=1 <vllm venv>/bin/python \
        benchmarks/vllm_worker.py --target DIR --max-batch 8 [--spec JSON]

vLLM starts with ``enforce_eager=True`` (its CPU build's documented setup for small models; no
compile), bfloat16, the given ``speculative_config``. Then each stdin line is one JSON request,
``{"prompts": [[ids...]...], "max_new_tokens": N, "temperature": T, "concurrency": R, "seed": S}``:
the prompts (token ids, rendered by the caller) are generated R at a time, every request exactly N
tokens (``ignore_eos``), and one line ``@@result {...}`` comes back on stdout with the wall seconds
of the generation, the token ids and the speculative counters. ``{"quit": true}`` ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MARK = "@@result "


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--spec", default=None, help="speculative_config as JSON")
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=a.target, dtype="bfloat16", max_model_len=2048, max_num_seqs=a.max_batch, enforce_eager=True,
              speculative_config=json.loads(a.spec) if a.spec else None, disable_log_stats=False, seed=0)

    def counters() -> dict[str, float]:
        names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens")
        return {m.name: m.value for m in llm.get_metrics() if m.name in names}  # pyright: ignore[reportAttributeAccessIssue]

    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        params = SamplingParams(temperature=req["temperature"], max_tokens=req["max_new_tokens"],
                                min_tokens=req["max_new_tokens"], ignore_eos=True, seed=req.get("seed", 0))
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        step = req["concurrency"]
        before = counters()
        t0 = time.perf_counter()
        outs = []
        if step == 1:  # one request at a time, as a user of one stream
            for p in prompts:
                outs += llm.generate([p], params, use_tqdm=False)
        else:  # continuous batching, at most max_num_seqs (= the caller's R) at once
            outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = counters()
        delta = {k.removeprefix("vllm:spec_decode_"): after[k] - before.get(k, 0) for k in after}
        print(MARK + json.dumps({"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                                 "spec": delta}), flush=True)


if __name__ == "__main__":
    main()
