"""vLLM's side of ``benchmarks/vs_vllm.py``: one vLLM engine in vLLM's own environment, driven over
stdin/stdout (imports vLLM and the standard library only; never dspec).

    LD_PRELOAD=<vllm venv>/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=1 <vllm venv>/bin/python \
        benchmarks/vllm_worker.py --target DIR --max-batch 8 [--spec JSON]

vLLM starts with ``enforce_eager=True`` (its CPU build's documented setup for small models; no
compile), bfloat16, the given ``speculative_config``. Then each stdin line is one JSON request,
``{"prompts": [[ids...]...], "max_new_tokens": N, "temperature": T, "concurrency": R, "seed": S}``:
the prompts (token ids, rendered by the caller) are generated R at a time, every request exactly N
tokens (``ignore_eos``), and one line ``@@result {...}`` comes back on stdout with the wall seconds
of the generation, the token ids and the speculative counters. With ``"profile": true`` the
generation runs under ``torch.profiler`` and the result is :func:`step_profile`'s instead; that
needs the engine in this process (``--in-process``: vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
which also skips its thread binding, so its timings are not the benchmark's). ``{"quit": true}``
ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MARK = "@@result "
# op name fragments -> the phase of a decoding step they belong to (first match wins; attention's
# batched matmuls before the linear layers' matmuls)
PHASES = (
    ("attention", ("attention", "attn", "softmax", "cumsum", "amax", "bmm", "paged", "exp_")),
    ("linear", ("linear", "mm", "onednn", "gemm")),
    ("sampling", ("argmax", "searchsorted", "multinomial", "topk", "sort")),
    ("kv cache write", ("scatter", "index_put", "reshape_and_cache", "::copy_")),
)


def step_profile(events, wall: float, tokens: int) -> dict:
    """Where a generation's time went, in ms per generated token, from ``torch.profiler`` events:
    the top-level operators by :data:`PHASES` ("other ops": the rest) and "host (Python, no
    operator running)": the wall time outside every operator."""
    out: dict[str, float] = {}
    for event in events:
        if event.cpu_parent is not None or event.device_type.name != "CPU" or event.name.startswith("ProfilerStep"):
            continue
        name = event.name.lower() + "_"  # "aten::exp_" and "aten::exp" alike, not "aten::expand"
        phase = next((p for p, keys in PHASES if any(k in name for k in keys)), "other ops")
        out[phase] = out.get(phase, 0.0) + event.cpu_time_total / 1e3  # µs -> ms
    ops = sum(out.values())
    out = {k: round(v / tokens, 4) for k, v in sorted(out.items())}
    out["host (Python, no operator running)"] = round(max(wall * 1e3 - ops, 0.0) / tokens, 4)
    out["total"] = round(wall * 1e3 / tokens, 4)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--spec", default=None, help="speculative_config as JSON")
    ap.add_argument("--in-process", action="store_true", help="the engine in this process (profiling)")
    a = ap.parse_args(argv)
    if a.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
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
        if req.get("profile"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:1], params, use_tqdm=False)
                wall = time.perf_counter() - t0
            print(MARK + json.dumps(step_profile(prof.events(), wall, len(outs[0].outputs[0].token_ids))), flush=True)
            continue
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
