"""Batched speculative generation with continuous batching (docs/architecture.md).

One loop serves R concurrent requests: finished requests leave, queued ones join. Each
round: the drafter proposes, the scheduler picks ℓ_r, the target verifies all rows in one
ragged forward, the verifier accepts a prefix plus one correction/bonus token per row, and
target and drafter caches keep only committed tokens. With no drafter the same loop is
plain autoregressive decoding (ℓ_r = 0): the baseline shares sampler and target path.

Randomness is counter-based per request: every draw is keyed by (request seed, request
round, position, purpose), so a request's output does not depend on what else is batched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dspec_cli.core import sampling
from dspec_cli.core.errors import DspecError
from dspec_cli.core.ragged import prefix_mask, ragged
from dspec_cli.core.sampling import (
    DRAFT_SALT,
    ENGINE_COIN_SALT,
    FIRST_TOKEN_SALT,
    NOISE_SALT,
    ROUND_STRIDE,
    TREE_DRAFT_SALT,
)
from dspec_cli.core.types import Proposal, VerifyResult
from dspec_cli.runtime.drafter import Drafter
from dspec_cli.runtime.drafter_lag import DrafterLag
from dspec_cli.runtime.schedule import FixedScheduler, Scheduler
from dspec_cli.runtime.target import Target, TargetBatch
from dspec_cli.runtime.verify import (
    CHAIN_METHODS,
    verify_chain,
    verify_greedy,
    verify_tree,
)
from dspec_cli.runtime.verify.tree import SAMPLED_METHODS


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    block_size: int = 7  # γ: most draft tokens verified per round
    max_batch: int = 1  # concurrent requests (continuous batching)
    seed: int = 0
    chain_verify: str = "block"  # chains with draft probabilities: "token" or "block" (docs/verification.md)
    tree_verify: str = "traversal"  # trees of sampled siblings: "sampled" (recursive rejection) or "traversal"

    def __post_init__(self) -> None:
        if self.block_size < 0:  # 0 = no drafting (plain decoding)
            raise DspecError(f"--block-size must be >= 0, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise DspecError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise DspecError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DspecError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DspecError(f"--top-k must be >= 0, got {self.top_k}")
        if self.max_batch < 1:
            raise DspecError(f"concurrency must be >= 1, got {self.max_batch}")
        if self.chain_verify not in CHAIN_METHODS:
            raise DspecError(f"--verify: chains are verified by {' or '.join(CHAIN_METHODS)}, got {self.chain_verify!r}")
        if self.tree_verify not in SAMPLED_METHODS:
            raise DspecError(f"--verify: sampled trees are verified by {' or '.join(SAMPLED_METHODS)}, got {self.tree_verify!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestResult:
    """One finished request and its per-round statistics."""

    index: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    verified: list[int] = field(default_factory=list)  # ℓ per round
    accepted: list[int] = field(default_factory=list)  # accepted drafts per round
    proposed: list[int] = field(default_factory=list)  # drafts the drafter offered per round
    confidence: list[list[float]] = field(default_factory=list)  # per round, per verified position
    start_time: float = 0.0  # perf_counter when the request joined the batch
    end_time: float = 0.0  # ... and when it finished


@dataclass
class RunStats:
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # = forward + accept + update seconds
    forward_seconds: float = 0.0  # target forward of the verified tokens
    accept_seconds: float = 0.0  # target probabilities, rejection sampling / tree walk
    update_seconds: float = 0.0  # target cache commit and drafter advance
    prefill_seconds: float = 0.0
    other_seconds: float = 0.0
    rounds: int = 0
    drafted_rounds: int = 0  # rounds with a proposal (the rest were plain steps: no drafter, gate closed, budget 0)
    verify_tokens: int = 0  # tokens sent to the target in verify passes
    verify_rules: dict[str, int] = field(default_factory=dict)  # drafted rounds by verification rule


class RoundSampler:
    """The drafter's sampler for one round: run settings + per-request counter randomness.

    Draft k of a request uses one counter-based uniform keyed (seed, round base + k) and
    inverse-CDF sampling: drafts may come from any randomness independent of the verifier's,
    and one number per draft (instead of V for an exponential race) keeps the sequential
    draft loops cheap.
    """

    def __init__(self, config: GenerationConfig, seeds: torch.Tensor, rounds: torch.Tensor, steps: int):
        """seeds [R] and rounds [R] (rounds so far) of the rows; ``steps`` draws per row this round."""
        self.config = config
        self.seeds = seeds  # [R] int64
        self.base = rounds * ROUND_STRIDE  # [R] int64
        self.steps = steps  # draws per request this round (uniforms for all of them are made at once)
        self._uniforms: torch.Tensor | None = None  # [R, steps]
        self.greedy = config.greedy

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R, V]
        c = self.config
        return sampling.logits_to_probs(logits, c.temperature, c.top_k, c.top_p)

    def sample(self, probs: torch.Tensor, step: int) -> torch.Tensor:  # [R, V] -> [R]; [R, n, V] -> [R, n]
        if self.config.greedy:
            return probs.argmax(-1)
        n = 1 if probs.dim() == 2 else probs.shape[1]
        if self._uniforms is None or step + n > self._uniforms.shape[1]:
            width = max(self.steps, step + n)
            offsets = self.base[:, None] + torch.arange(width, device=self.seeds.device)  # [R, width]
            self._uniforms = sampling.uniform(self.seeds[:, None], offsets, salt=DRAFT_SALT)
        u = self._uniforms[:, step : step + n]  # [R, n]
        if probs.dim() == 2:
            return sampling.sample_inverse_cdf(probs, u[:, 0])
        return sampling.sample_inverse_cdf(probs.flatten(0, 1), u.flatten()).view(u.shape)

    def sample_distinct(self, probs: torch.Tensor, n: int, step: int) -> torch.Tensor:  # [R, W, V] -> [R, W, n]
        """n draws without replacement from each of W distributions per request, in draw order
        (successive inverse-CDF draws, each without the tokens drawn before). Draw j of row w at tree
        depth ``step`` uses the uniform at (seed, round base + step), salt TREE_DRAFT_SALT + 256·w + j."""
        R, W, V = probs.shape
        dev = probs.device
        if n == 0:
            return probs.new_zeros(R, W, 0, dtype=torch.long)
        salt = TREE_DRAFT_SALT + (torch.arange(W, device=dev)[:, None] << 8) + torch.arange(n, device=dev)  # [W, n]
        u = sampling.uniform(self.seeds[:, None, None], (self.base + step)[:, None, None], salt).view(R * W, n)
        return sampling.sample_without_replacement(probs.reshape(R * W, V), u).view(R, W, n)


class SpeculativeEngine:
    """Generate continuations for many prompts, R at a time, with an optional drafter."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        config: GenerationConfig | None = None,
        scheduler: Scheduler | None = None,
        stop_ids: Sequence[int] | None = None,
    ):
        self.target = target
        self.drafter = drafter
        self.config = config or GenerationConfig()
        self.scheduler = scheduler if scheduler is not None else FixedScheduler()
        self.stop_ids = set(target.eos_token_ids if stop_ids is None else stop_ids)
        self.stats = RunStats()
        # CPU: target tokens by inverse CDF with one uniform per row (a vocabulary-wide noise
        # vector costs ~0.5 ms per step there); elsewhere the exponential race (the Triton verifier's)
        self._inverse_cdf = target.device.type == "cpu"

    # -- public ------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int] | None = None,
        on_finish: Callable[[RequestResult], None] | None = None,
    ) -> list[RequestResult]:
        """Generate for every prompt; results in prompt order. ``on_finish`` drives progress bars."""
        cfg = self.config
        self._check_prompts(prompts)
        seeds = list(seeds) if seeds is not None else [cfg.seed * 1_000_003 + i for i in range(len(prompts))]
        results = [RequestResult(i, list(p)) for i, p in enumerate(prompts)]
        queue = list(range(len(prompts)))
        layer_ids = self.drafter.target_layer_ids if self.drafter is not None else ()
        rows = _Rows(self.target.new_batch(layer_ids), self.drafter.init_state() if self.drafter else None, self.target.device)
        self.scheduler.reset()  # schedulers with history (async) start fresh per run
        while queue or rows.active:
            if queue and len(rows.active) < cfg.max_batch:
                admit, queue = queue[: cfg.max_batch - len(rows.active)], queue[cfg.max_batch - len(rows.active) :]
                self._admit(rows, admit, prompts, seeds, results)
            else:
                self._round(rows, results)
            self._retire(rows, results, on_finish)
        return results

    # -- the cycle -----------------------------------------------------------------------
    def _admit(self, rows: _Rows, new: list[int], prompts, seeds, results) -> None:
        """Prefill new requests into the running batch and sample their first token."""
        t0 = time.perf_counter()
        dev = self.target.device
        out = self.target.prefill(rows.batch, [list(prompts[i]) for i in new])
        new_seeds = torch.tensor([seeds[i] for i in new], dtype=torch.long, device=dev)
        first = self._sample(out.logits, new_seeds, torch.zeros_like(new_seeds), FIRST_TOKEN_SALT)
        if self.drafter is not None:  # the drafter gets them before it next drafts (DrafterLag)
            ids = [torch.tensor(prompts[i], dtype=torch.long, device=dev) for i in new]
            rows.lag.admit(ids, out.hidden if self.drafter.target_layer_ids else None)
        rows.active += new
        now = time.perf_counter()
        for i in new:
            results[i].start_time = now
        rows.anchors = torch.cat([rows.anchors, first])
        rows.seeds = torch.cat([rows.seeds, new_seeds])
        rows.rounds = torch.cat([rows.rounds, torch.ones_like(new_seeds)])
        for i, tok in zip(new, first.tolist(), strict=True):
            results[i].output_ids.append(tok)
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _round(self, rows: _Rows, results: list[RequestResult]) -> None:
        t0 = time.perf_counter()
        proposal, ell = self._draft(rows, results)
        t1 = time.perf_counter()
        if proposal is not None and proposal.tree is not None:
            # a row verifying nothing (token budget spent) gets an empty tree: its token is then the
            # root's sample, the one a plain step would give (so outputs do not depend on the batch)
            nodes = torch.where(ell > 0, proposal.tree.num_nodes.to(self.target.device), 0)
            res, committed, keep, hidden, tf, ta = self._verify_tree(rows, proposal, nodes)
            if self.drafter is not None:
                self.drafter.advance(rows.dstate, committed, keep, hidden)
            self._book(rows, results, res, proposal, nodes, (t0, t1, tf, ta, time.perf_counter()),
                       int(nodes.sum()) + len(rows.active))
            return
        # 2. verify: [anchor, x_1..x_ℓ] per row, flattened
        ell_list = ell.tolist()
        n = ell + 1
        width = max(ell_list)
        grid = rows.anchors[:, None]  # [R, 1 + width]: anchor, then the verified drafts
        if proposal is not None:
            grid = torch.cat([grid, proposal.tokens[:, :width].to(grid.dtype)], dim=1)
        tokens = ragged(grid, n, [e + 1 for e in ell_list])
        out = self.target.verify(rows.batch, tokens, n)
        tf = time.perf_counter()
        res = self._accept(rows, out, grid, proposal, ell, ell_list)
        ta = time.perf_counter()
        # 3. commit: anchor + accepted drafts enter the caches; the last token is the new anchor
        keep = res.accepted + 1
        self.target.commit(rows.batch, keep)
        if self.drafter is not None and proposal is None:
            # a plain step (one token per row, flat layout = rows): the drafter catches up later
            rows.lag.skip(grid[:, 0], keep, out.hidden)
        elif self.drafter is not None:
            hidden = out.hidden
            if hidden is not None:  # committed entries of the flat verify layout
                hidden = hidden[ragged(prefix_mask(keep, grid.shape[1]), n, [e + 1 for e in ell_list])]
            self.drafter.advance(rows.dstate, ragged(grid, keep, keep.tolist()), keep, hidden)
        self._book(rows, results, res, proposal, ell, (t0, t1, tf, ta, time.perf_counter()), tokens.numel())

    def _draft(self, rows: _Rows, results: list[RequestResult]) -> tuple[Proposal | None, torch.Tensor]:
        """1. draft: the drafter proposes, the scheduler picks ℓ [R] (zeros without a drafter)."""
        cfg, dev = self.config, self.target.device
        R = len(rows.active)
        # drafts beyond the token budget are wasted
        budget = [min(max(cfg.max_new_tokens - len(results[i].output_ids) - 1, 0), cfg.block_size) for i in rows.active]
        sched = self.scheduler
        if sched.cost_table is not None:  # mean context for cost-table lookups (host-side)
            sched.observe_context(sum(len(results[i].prompt_ids) + len(results[i].output_ids) for i in rows.active) / R)
        if self.drafter is None or max(budget) == 0 or not sched.wants_draft(R, cfg.block_size):
            return None, torch.zeros(R, dtype=torch.long, device=dev)
        t0 = time.perf_counter()
        rows.lag.flush(self.drafter, rows.dstate)
        rows.catch_up = time.perf_counter() - t0
        max_len = cfg.block_size  # not max(budget): a draft tree's shape must not depend on other rows
        sampler = RoundSampler(cfg, rows.seeds, rows.rounds, max_len)
        proposal = self.drafter.propose(rows.dstate, rows.anchors, max_len, sampler)
        if proposal.confidence is None:
            proposal.confidence = self.drafter.confidence(rows.dstate, proposal)
        if self.drafter.calibration is not None:  # STS, the one place it is applied
            proposal.confidence = self.drafter.calibration.apply(proposal.confidence)
        lmax = torch.minimum(proposal.lengths, torch.tensor(budget, dtype=torch.long, device=dev))
        ell = sched(proposal, lmax)
        sched.observe_draft_time(R, time.perf_counter() - t0)
        return proposal, ell

    def _accept(self, rows: _Rows, out, grid, proposal: Proposal | None, ell, ell_list: list[int]) -> VerifyResult:
        """Verify the chains: grid [R, 1 + max ℓ] (anchor, drafts), target output of the flat chains."""
        cfg = self.config
        width = grid.shape[1] - 1
        if width == 0:  # no row verifies a draft: a plain decoding step (the same token verify would give)
            return _plain_step(self._sample(out.logits, rows.seeds, rows.rounds * ROUND_STRIDE, NOISE_SALT))
        drafts = ragged(grid[:, 1:], ell, ell_list)
        if cfg.greedy:
            self._count_rule("greedy")
            return verify_greedy(out.logits, drafts, ell, validate=False)
        probs = sampling.logits_to_probs(out.logits, cfg.temperature, cfg.top_k, cfg.top_p)
        q = None if proposal is None or proposal.draft_probs is None else ragged(proposal.draft_probs[:, :width], ell,
                                                                                   ell_list)
        method = cfg.chain_verify if q is not None else "token"  # one-hot drafts: block = token in law
        self._count_rule(method)
        base = rows.rounds * ROUND_STRIDE  # [R]
        dev = base.device
        at = base[:, None] + torch.arange(width + 1, device=dev)  # [R, 1 + width]: final at base, draft k at base + k
        salts = torch.tensor([NOISE_SALT] + [ENGINE_COIN_SALT] * width, device=dev)
        u = sampling.uniform(rows.seeds[:, None], at, salt=salts)  # one call for the coins and the final draw
        coins = ragged(u[:, 1:], ell, ell_list)
        if self._inverse_cdf:
            return verify_chain(probs, drafts, q, ell, method=method, uniforms=coins, final_uniforms=u[:, 0], validate=False)
        noise = sampling.exponential(rows.seeds, base, probs.shape[-1], salt=NOISE_SALT)
        return verify_chain(probs, drafts, q, ell, method=method, uniforms=coins, noise=noise, validate=False)

    def _verify_tree(self, rows: _Rows, proposal: Proposal, nodes: torch.Tensor):
        """Verify one draft tree per row in one target pass: the configured rule for sampled
        siblings (``tree_verify``: "traversal" or "sampled") when the tree carries draft
        probabilities and T > 0, else the sample-and-match walk."""
        cfg, dev = self.config, self.target.device
        tree = proposal.tree
        assert tree is not None  # a tree round
        R = len(rows.active)
        n = nodes + 1  # anchor (root) + nodes [R]
        total = int(n.sum())
        starts = torch.cumsum(n, 0) - n
        flat_row = torch.repeat_interleave(torch.arange(R, device=dev), n, output_size=total)
        flat_pos = torch.arange(total, device=dev) - starts[flat_row]  # 0 = root
        is_node = flat_pos > 0
        tokens = rows.anchors[flat_row].clone()
        tokens[is_node] = tree.tokens[flat_row[is_node], flat_pos[is_node] - 1].to(dev)
        parents = torch.full_like(tokens, -1)
        parents[is_node] = tree.parents[flat_row[is_node], flat_pos[is_node] - 1].to(dev)
        out = self.target.verify_tree(rows.batch, tokens, parents, n)
        tf = time.perf_counter()
        probs = sampling.logits_to_probs(out.logits, cfg.temperature, cfg.top_k, cfg.top_p)
        q = None
        if tree.draft_probs is not None and not cfg.greedy:
            q = tree.draft_probs.to(dev)[flat_row, flat_pos]  # [total, V], aligned with probs
        method = "match" if q is None else cfg.tree_verify
        self._count_rule(method)
        res = verify_tree(
            probs, tokens[is_node], parents[is_node], nodes, method=method,
            draft_probs=q, seeds=rows.seeds, offsets=rows.rounds * ROUND_STRIDE, validate=False,
            final_draw="inverse_cdf" if self._inverse_cdf else "race",
        )  # fmt: skip
        ta = time.perf_counter()
        path = res.path
        assert path is not None  # tree verification returns the accepted path
        self.target.commit_path(rows.batch, path)
        keep = res.accepted + 1  # root + accepted nodes
        on_path = path >= 0  # [R, D+1]
        idx = (starts[:, None] + path.clamp(min=0))[on_path]  # flat rows of the path, row-major
        hidden = out.hidden[idx] if out.hidden is not None else None
        return res, tokens[idx], keep, hidden, tf, ta

    def _book(self, rows, results, res, proposal, ell, times: tuple[float, ...], verify_tokens: int) -> None:
        """Per-request statistics and outputs of one round (one host sync). ``times``: perf_counter
        at the round's start, after drafting, the target forward, acceptance and the cache update."""
        t0, t1, tf, ta, t2 = times
        R = len(rows.active)
        acc_list, ell_list = res.accepted.tolist(), ell.tolist()
        out_tokens = res.tokens.tolist()
        prop_list = proposal.lengths.tolist() if proposal is not None else [0] * R
        conf = proposal.confidence.tolist() if proposal is not None and proposal.confidence is not None else None
        for r, i in enumerate(rows.active):
            res_i = results[i]
            res_i.output_ids.extend(out_tokens[r][: acc_list[r] + 1])
            res_i.verified.append(ell_list[r])
            res_i.accepted.append(acc_list[r])
            res_i.proposed.append(prop_list[r])
            if conf is not None:
                res_i.confidence.append(conf[r][: ell_list[r]])
        rows.anchors = res.tokens.gather(1, res.accepted[:, None]).squeeze(1)
        rows.rounds = rows.rounds + 1
        self.stats.rounds += 1
        self.stats.drafted_rounds += proposal is not None
        self.stats.verify_tokens += verify_tokens
        self.stats.draft_seconds += t1 - t0
        self.stats.verify_seconds += t2 - t1
        self.stats.forward_seconds += tf - t1
        self.stats.accept_seconds += ta - tf
        self.stats.update_seconds += t2 - ta
        t3 = time.perf_counter()
        self.stats.other_seconds += t3 - t2
        self.scheduler.observe_round(R, t3 - t0, proposal is not None, R + sum(acc_list), rows.catch_up)
        rows.catch_up = 0.0

    def _retire(self, rows: _Rows, results: list[RequestResult], on_finish) -> None:
        """Finished requests leave the batch (stop token or max_new_tokens)."""
        done = []
        for r, i in enumerate(rows.active):
            res = results[i]
            reason = self._truncate(res)
            if reason:
                res.finish_reason = reason
                done.append(r)
        if not done:
            return
        keep = [r for r in range(len(rows.active)) if r not in set(done)]
        self.target.remove(rows.batch, done)
        if self.drafter is not None:
            rows.lag.keep(self.drafter, rows.dstate, keep)
        idx = torch.tensor(keep, dtype=torch.long, device=rows.anchors.device)
        rows.anchors, rows.seeds, rows.rounds = rows.anchors[idx], rows.seeds[idx], rows.rounds[idx]
        finished = [rows.active[r] for r in done]
        rows.active = [rows.active[r] for r in keep]
        now = time.perf_counter()
        for i in finished:
            results[i].end_time = now
        if on_finish is not None:
            for i in finished:
                on_finish(results[i])

    # -- helpers -------------------------------------------------------------------------
    def _truncate(self, res: RequestResult) -> str:
        """Cut the output after a stop token or at max_new_tokens; return why it finished."""
        for j, tok in enumerate(res.output_ids):
            if tok in self.stop_ids:
                del res.output_ids[j + 1 :]
                return "stop"
        if len(res.output_ids) >= self.config.max_new_tokens:
            del res.output_ids[self.config.max_new_tokens :]
            return "length"
        return ""

    def _sample(self, logits: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, salt: int) -> torch.Tensor:
        """One target token per row from logits [R, V] at the run's settings."""
        cfg = self.config
        if cfg.greedy:
            return logits.argmax(-1)
        probs = sampling.logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        if self._inverse_cdf:
            return sampling.sample_inverse_cdf(probs, sampling.uniform(seeds, offsets, salt=salt))
        return sampling.sample_from_probs(probs, sampling.exponential(seeds, offsets, probs.shape[-1], salt=salt))

    def _count_rule(self, rule: str) -> None:
        self.stats.verify_rules[rule] = self.stats.verify_rules.get(rule, 0) + 1

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        cfg = self.config
        max_ctx = self.target.max_context
        vocab = self.target.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise DspecError(f"prompt {i} is empty")
            if max_ctx and len(p) + cfg.max_new_tokens + cfg.block_size + 1 > max_ctx:
                raise DspecError(
                    f"prompt {i} has {len(p)} tokens; with --max-new-tokens {cfg.max_new_tokens} it exceeds "
                    f"the target's context of {max_ctx} tokens"
                )
            if max(p) >= vocab or min(p) < 0:
                raise DspecError(f"prompt {i} has token ids outside the target vocabulary (size {vocab})")


def _plain_step(tokens: torch.Tensor) -> VerifyResult:
    """The verify result of a round without drafts: one sampled token per row."""
    zero = torch.zeros_like(tokens)
    return VerifyResult(accepted=zero, tokens=tokens[:, None], num_tokens=zero + 1)


@dataclass
class _Rows:
    """The running batch: target cache, drafter state and per-row tensors, in row order."""

    batch: TargetBatch
    dstate: Any  # the drafter's DraftState; None without a drafter
    device: torch.device
    active: list[int] = field(default_factory=list)  # request index per row
    lag: DrafterLag = field(default_factory=DrafterLag)  # what the drafter has not seen yet
    catch_up: float = 0.0  # seconds this round's lag hand-over took

    def __post_init__(self) -> None:
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        self.anchors = empty  # [R] last sampled token, not yet in the target cache
        self.seeds = empty  # [R] per-request seed
        self.rounds = empty  # [R] per-request round counter (randomness key)
