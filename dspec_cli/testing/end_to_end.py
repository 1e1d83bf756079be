"""End-to-end checks on a real target: the engine's first tokens against the exact
probabilities of every likely continuation, and outputs that do not depend on the batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspec_cli.core.sampling import logits_to_probs
from dspec_cli.runtime.engine import GenerationConfig, SpeculativeEngine
from dspec_cli.testing.gof import GofResult, gof_test, joint_index


@dataclass
class Continuations:
    """Exact probabilities of every continuation of ``depth`` tokens with probability >= min_prob."""

    tuples: torch.Tensor  # [K, depth] long
    probs: torch.Tensor  # [K] float64
    depth: int


@torch.no_grad()
def exact_continuations(target, prompt: Sequence[int], *, depth: int, min_prob: float, temperature: float = 1.0,
                        top_k: int = 0, top_p: float = 1.0, chunk: int = 512) -> Continuations:
    """Enumerate continuations of ``prompt`` under the target at the given sampling settings.

    Prefixes are expanded breadth-first, keeping only those whose probability is at least
    ``min_prob`` (so at most 1/min_prob per depth); the remaining mass becomes one "other" bin
    in :func:`assert_continuations_match`. Uses full forwards of ``target.model`` (the
    reference, independent of the engine's cache machinery).
    """
    model = target.model
    prefixes = torch.empty(1, 0, dtype=torch.long)
    weights = torch.ones(1, dtype=torch.float64)
    base = torch.tensor(list(prompt), dtype=torch.long)
    for _ in range(depth):
        rows = []
        for start in range(0, prefixes.shape[0], chunk):
            part = prefixes[start : start + chunk]
            ids = torch.cat([base.expand(part.shape[0], -1), part], 1).to(target.device)
            logits = model(input_ids=ids).logits[:, -1].float()
            rows.append(logits_to_probs(logits, temperature, top_k, top_p).double().cpu())
        joint = weights[:, None] * torch.cat(rows)  # [P, V]
        keep = (joint >= min_prob).nonzero()
        prefixes = torch.cat([prefixes[keep[:, 0]], keep[:, 1:]], 1)
        weights = joint[keep[:, 0], keep[:, 1]]
    return Continuations(prefixes, weights, depth)


def assert_continuations_match(samples: torch.Tensor, exact: Continuations, *, alpha: float = 1e-4,
                               name: str = "continuations") -> GofResult:
    """Chi-square of sampled continuations [N, depth] against :func:`exact_continuations`."""
    V = int(max(int(samples.max()), int(exact.tuples.max()))) + 1
    keys = joint_index(exact.tuples, V)
    order = torch.argsort(keys)
    keys, probs = keys[order], exact.probs[order]
    idx = joint_index(samples.cpu(), V)
    pos = torch.searchsorted(keys, idx).clamp(max=len(keys) - 1)
    hit = keys[pos] == idx
    category = torch.where(hit, pos, torch.full_like(pos, len(keys)))  # last bin: everything else
    expected = torch.cat([probs, (1 - probs.sum()).clamp(min=0).reshape(1)])
    result = gof_test(category, expected)
    if result.p_value < alpha:
        raise AssertionError(f"distribution mismatch (alpha = {alpha:g})\n" + result.describe(name))
    return result


def check_engine_lossless(target, drafter, prompts: Sequence[Sequence[int]], *, per_prompt: int, sampling: dict,
                          block_size: int = 3, max_batch: int | None = None, seed: int = 11, scheduler=None,
                          name: str = "engine", verify: dict | None = None) -> list:
    """End-to-end check: the first 3 tokens the engine generates for each prompt (``per_prompt``
    seeded samples, 4 new tokens so round 1 verifies up to 2 drafts) match exact target
    sampling at ``sampling``; ``verify`` sets how the engine verifies (``chain_verify``,
    ``tree_verify``, ``batch_invariant``; default: the engine's). Returns every request result, for
    extra assertions."""

    cfg = GenerationConfig(max_new_tokens=4, block_size=block_size, max_batch=max_batch or per_prompt, seed=seed,
                           **sampling, **(verify or {}))
    engine = SpeculativeEngine(target, drafter, cfg, scheduler=scheduler, stop_ids=[])
    out = []
    for i, prompt in enumerate(prompts):
        results = engine.generate([prompt] * per_prompt, seeds=[i * 10**6 + s for s in range(per_prompt)])
        samples = torch.tensor([r.output_ids[:3] for r in results])
        exact = exact_continuations(target, prompt, depth=3, min_prob=2e-4, **sampling)
        assert_continuations_match(samples, exact, name=f"{name} prompt {i} {sampling}")
        out += results
    return out


def results_by_concurrency(target, drafter, prompts: Sequence[Sequence[int]], concurrencies: Sequence[int],
                           **config) -> list[list]:
    """The engine's results for ``prompts``, once per concurrency (``max_batch``) with the same
    seeds; equal ``output_ids`` across them show the outputs do not depend on the batch."""

    return [
        SpeculativeEngine(target, drafter, GenerationConfig(max_batch=conc, **config), stop_ids=[]).generate(prompts)
        for conc in concurrencies
    ]
