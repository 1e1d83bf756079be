"""Batched speculative generation with continuous batching (docs/architecture.md).

One loop serves R concurrent requests: finished requests leave, queued ones join. Each
round: the drafter proposes, the scheduler picks ℓ_r, the target verifies all rows in one
padded-grid forward (R rows × the round's width), the verifier accepts a prefix plus one
correction/bonus token per row, and target and drafter caches keep only committed tokens.
With no drafter the same loop is plain autoregressive decoding (ℓ_r = 0): the baseline
shares sampler and target path.

Randomness is counter-based per request: every draw is keyed by (request seed, request
round, position, purpose), so a request's output does not depend on what else is batched.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dspec_cli.core import sampling
from dspec_cli.core.errors import DspecError
from dspec_cli.core.host import reads_free
from dspec_cli.core.sampling import (
    DRAFT_SALT,
    ENGINE_COIN_SALT,
    FIRST_TOKEN_SALT,
    NOISE_SALT,
    ROUND_STRIDE,
    TREE_DRAFT_SALT,
    CounterNoise,
    SamplingConfig,
)
from dspec_cli.core.specs import check_block_size
from dspec_cli.core.types import Capability, DraftTree, Proposal, VerifyResult
from dspec_cli.runtime.drafter import Drafter, warn_if_other_rule
from dspec_cli.runtime.drafter_lag import DrafterLag
from dspec_cli.runtime.graphs import MODES, GraphRunner, GraphSettings
from dspec_cli.runtime.kv_cache import TargetBatch
from dspec_cli.runtime.schedule import FixedScheduler, Scheduler
from dspec_cli.runtime.target import Target
from dspec_cli.runtime.verify import (
    CHAIN_METHODS,
    sample_logits,
    verify_chain_grid,
    verify_chain_logits_grid,
    verify_greedy_grid,
    verify_tree_grid,
)
from dspec_cli.runtime.verify.tree import SAMPLED_METHODS

FREE_INVARIANCE_ROWS = 8  # compiled rounds of this many rows or more verify batch-invariantly by default


@dataclass(frozen=True)
class GenerationConfig(SamplingConfig):
    """A run's settings: sampling (:class:`~dspec_cli.core.sampling.SamplingConfig`), budget,
    block size, batching, verification rules and how rounds run."""

    max_new_tokens: int = 128
    block_size: int = 7  # γ: most draft tokens verified per round
    max_batch: int = 1  # concurrent requests (continuous batching)
    chain_verify: str = "block"  # chains with draft probabilities: "token" or "block" (docs/verification.md)
    tree_verify: str = "sampled"  # trees of sampled siblings: "sampled" (recursive rejection) or "traversal"
    # how rounds run: "auto" (CUDA graphs on a CUDA device, else eagerly), "cuda", "eager",
    # "compile" (torch.compile(fullgraph=True), reduce-overhead on CUDA) or "check" (eagerly,
    # checking what capture needs); runtime/graphs.py
    graphs: str = "auto"
    # batch-invariant target forwards (greedy output the same with every drafter): None = the
    # default rule (batch_invariance), True, False
    batch_invariant: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_block_size(self.block_size)
        if self.max_new_tokens < 1:
            raise DspecError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_batch < 1:
            raise DspecError(f"concurrency must be >= 1, got {self.max_batch}")
        if self.chain_verify not in CHAIN_METHODS:
            raise DspecError(f"--verify: chains are verified by {' or '.join(CHAIN_METHODS)}, got {self.chain_verify!r}")
        if self.tree_verify not in SAMPLED_METHODS:
            raise DspecError(f"--verify: sampled trees are verified by {' or '.join(SAMPLED_METHODS)}, got {self.tree_verify!r}")
        if self.graphs not in ("auto", *MODES):
            raise DspecError(f"graphs must be one of auto, {', '.join(MODES)}, got {self.graphs!r}")

    def graph_settings(self, device: torch.device) -> GraphSettings:
        """The graph mode on ``device``: "auto" captures CUDA graphs on a CUDA device."""
        if self.graphs == "auto":
            return GraphSettings.for_device(device)
        if self.graphs == "cuda" and device.type != "cuda":
            raise DspecError(f"CUDA graphs need a CUDA device, not {device}")
        return GraphSettings(self.graphs)

    def batch_invariance(self, target: Target) -> bool:
        """Whether this run's target forwards are batch-invariant (runtime/decoder.py: a token's
        logits are the same bit for bit in a one-token step and in a verify of ℓ + 1 tokens, so at
        T = 0 every drafter's output is plain decoding's, in half precision too): ``batch_invariant``
        where given, else the default rule, kept here alone. The rule: on where it is free, off
        where it costs, as measured by ``benchmarks/batch_invariance.py`` against fused attention
        (docs/results/batch-invariance-*.json, 2-vCPU EPYC Zen 4, plain decoding): compiled rounds
        at 8 or more rows lose under 3 %, one request 10-20 % (eager or compiled), eager rounds
        at 8 rows about 9 %. Only dspec's own forward has the invariant attention, so True where
        transformers' forward runs is an error."""
        if self.batch_invariant and not target.lean:
            raise DspecError(f"batch-invariant verification needs dspec's own forward; this target runs "
                             f"transformers' forward ({target.lean_unsupported})")
        if self.batch_invariant is None:
            return target.lean and self.graphs == "compile" and self.max_batch >= FREE_INVARIANCE_ROWS
        return self.batch_invariant


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
    confidence: list[list[float]] = field(default_factory=list)  # per round, per verified position (calibrated)
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


@dataclass
class VerifyStep:
    """What a drafted round verifies with probabilities, as its acceptance sees it: given to an
    engine's ``observe`` callback (e.g. to verify the same drafts by other rules). Rows are the
    step's padded rows (rows past R verify nothing)."""

    rule: str  # the rule the engine applies: "token" / "block" (chains), "sampled" / "traversal" (trees)
    target_probs: torch.Tensor  # [n, W+1, V] chains; [n, N+1, V] trees (the root's row first)
    drafts: torch.Tensor  # [n, W] chain drafts; [n, N] tree tokens
    draft_probs: torch.Tensor  # [n, W, V] chains; [n, N+1, V] trees (q of each node's children)
    num_draft: torch.Tensor | None = None  # chains: ℓ [n]
    parents: torch.Tensor | None = None  # trees: [n, N] local parents (0 = root, -1: no node)
    depth: int = 0  # trees: >= the deepest node
    fanout: int = 0  # trees: >= the most children of a node


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
    """Generate continuations for many prompts, R at a time, with an optional drafter.

    A round's device work runs as static-shape steps (rows padded to a bucket, attention windows
    rounded up) through a :class:`~dspec_cli.runtime.graphs.GraphRunner`: CUDA graphs on a GPU,
    eagerly elsewhere. The round reads the device once, at its end: the accepted tokens, which
    decide what each request outputs and when it finishes. The KV caches, graphs and drafter
    state persist across :meth:`generate` calls of one engine. ``observe`` (eager rounds only)
    is called with a :class:`VerifyStep` in every round that verifies with draft probabilities.
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        config: GenerationConfig | None = None,
        scheduler: Scheduler | None = None,
        stop_ids: Sequence[int] | None = None,
        observe: Callable[[VerifyStep], None] | None = None,
    ):
        self.target = target
        self.drafter = drafter
        self.config = config or GenerationConfig()
        self.scheduler = scheduler if scheduler is not None else FixedScheduler()
        self.stop_ids = set(target.eos_token_ids if stop_ids is None else stop_ids)
        self.stats = RunStats()
        self.graphs = self.config.graph_settings(target.device)
        self.batch_invariant = self.config.batch_invariance(target)  # the setting this engine's forwards run
        if observe is not None and self.graphs.mode != "eager":
            raise DspecError(f"observe: needs eager rounds (graphs='eager'), not {self.graphs.mode!r}")
        self.observe = observe  # called inside every verify step with probabilities (eager rounds only)
        # CPU: target tokens by inverse CDF with one uniform per row (a vocabulary-wide noise
        # vector costs ~0.5 ms per step there), from float logits; elsewhere the exponential race
        # (the Triton verifier's), from logits in the model's dtype (the kernels upcast as they read)
        self._inverse_cdf = target.device.type == "cpu"
        self._session: _Session | None = None
        self._marks: list[float] = []  # phase boundaries inside an eager verify step
        if drafter is not None:  # its calibrated confidences steer the schedulers: fitted for this rule?
            warn_if_other_rule(drafter, self._chain_rule(Capability.draft_probs in drafter.capabilities))

    def _chain_rule(self, has_draft_probs: bool) -> str:
        """The rule chains are verified by: the configured one, or the token rule for one-hot drafts
        and greedy decoding (where both rules accept the same)."""
        return self.config.chain_verify if has_draft_probs and not self.config.greedy else "token"

    # -- public ------------------------------------------------------------------------
    @torch.no_grad()  # inference: no autograd graph (one through the persistent caches would never be freed)
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
        rows = self._rows(max(len(p) for p in prompts))
        self.scheduler.reset()  # schedulers with history (async) start fresh per run
        while queue or rows.active:
            if queue and len(rows.active) < cfg.max_batch:
                admit, queue = queue[: cfg.max_batch - len(rows.active)], queue[cfg.max_batch - len(rows.active) :]
                self._admit(rows, admit, prompts, seeds, results)
            else:
                self._round(rows, results)
            self._retire(rows, results, on_finish)
        return results

    def _rows(self, longest_prompt: int) -> _Rows:
        """The running batch of one generate call, on this engine's persistent session (KV
        caches with room for the run, graphs). The room is what the run's widest attention window
        needs (the longest prompt, every new token and the widest verify, rounded up to the window
        bucket and the batch's window multiple), so no round reallocates a cache; when this
        reservation reallocates one, the graphs captured over the old buffers are freed."""
        cfg, dev = self.config, self.target.device
        layer_ids = self.drafter.target_layer_ids if self.drafter is not None else ()
        if self._session is None:
            batch = self.target.new_batch(layer_ids, batch_invariant=self.batch_invariant)
            self._session = _Session(batch, self.drafter.init_state() if self.drafter else None, GraphRunner(self.graphs.mode))
        session = self._session
        rows = self.graphs.rows(cfg.max_batch)
        widest = self.drafter.verify_tokens(cfg.block_size) if self.drafter is not None else 1
        bucket = math.lcm(self.graphs.window(), session.batch.window_multiple)
        slots = -(-(longest_prompt + cfg.max_new_tokens + widest) // bucket) * bucket
        grew = session.batch.reserve(rows, slots)
        if self.drafter is not None:
            grew = self.drafter.reserve(session.dstate, rows, slots) or grew
        if grew:
            session.runner.clear()
        return _Rows(session.batch, session.dstate, dev, runner=session.runner)

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
            if self.scheduler.gate is None:  # every round drafts: hand them over now
                rows.lag.flush(self.drafter, rows.dstate)
        rows.active += new
        now = time.perf_counter()
        for i in new:
            results[i].start_time = now
        rows.anchors = torch.cat([rows.anchors, first])
        rows.seeds = torch.cat([rows.seeds, new_seeds])
        rows.rounds = torch.cat([rows.rounds, torch.ones_like(new_seeds)])
        rows.produced = torch.cat([rows.produced, torch.ones_like(new_seeds)])
        for i, tok in zip(new, first.tolist(), strict=True):
            results[i].output_ids.append(tok)
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _round(self, rows: _Rows, results: list[RequestResult]) -> None:
        t0 = time.perf_counter()
        R = len(rows.active)
        padded = self.graphs.rows(R)
        # drafts beyond the token budget are wasted (host-side: every output length is known)
        budget = [min(max(self.config.max_new_tokens - len(results[i].output_ids) - 1, 0), self.config.block_size)
                  for i in rows.active]  # fmt: skip
        proposal, ell = self._draft(rows, results, budget, padded)
        t1 = time.perf_counter()
        if proposal is not None and proposal.tree is not None:
            res, committed, keep, hidden, verified = self._verify_tree(rows, proposal, ell, padded)
        else:
            res, committed, keep, hidden = self._verify_chain(rows, proposal, ell, max(budget), padded)
            verified = ell
        tf, ta = self._phase_marks(t1)
        if self.drafter is not None and proposal is None and self.scheduler.gate is not None:
            # a plain step the draft gate chose (one token per row): the drafter catches up later
            rows.lag.skip(committed[:R, 0], keep[:R], None if hidden is None else hidden[:R, 0].clone())
        elif self.drafter is not None:
            self._advance(rows, committed, keep, hidden, padded)
        rows.anchors = res.tokens[:R].gather(1, res.accepted[:R, None]).squeeze(1)
        rows.produced = rows.produced + keep[:R]
        rows.rounds = rows.rounds + 1
        self._book(rows, results, res, proposal, verified, (t0, t1, tf, ta, time.perf_counter()))

    def _draft(self, rows: _Rows, results, budget: list[int], padded: int) -> tuple[Proposal | None, torch.Tensor]:
        """1. draft: the drafter proposes, the scheduler picks ℓ [R] (zeros without a drafter)."""
        cfg, dev = self.config, self.target.device
        R = len(rows.active)
        sched = self.scheduler
        if sched.cost_table is not None:  # mean context for cost-table lookups (host-side)
            sched.observe_context(sum(len(results[i].prompt_ids) + len(results[i].output_ids) for i in rows.active) / R)
        if self.drafter is None or max(budget) == 0 or not sched.wants_draft(R, cfg.block_size):
            return None, torch.zeros(R, dtype=torch.long, device=dev)
        t0 = time.perf_counter()
        rows.lag.flush(self.drafter, rows.dstate)
        rows.catch_up = time.perf_counter() - t0
        key = self.drafter.capture_key(rows.dstate, self.graphs.window())
        inputs = [rows.anchors, rows.seeds, rows.rounds]
        if key is None:  # not capturable: eagerly, unpadded
            fields = self._propose(*inputs)
        else:
            fields = rows.runner(("propose", padded, self._sampling(), key), self._propose, inputs, padded, role="propose")
        proposal = _proposal(fields, R)
        budget_now = (cfg.max_new_tokens - rows.produced - 1).clamp(0, cfg.block_size)  # = budget, on the device
        ell = sched(proposal, torch.minimum(proposal.lengths, budget_now))
        sched.observe_draft_time(R, time.perf_counter() - t0)
        return proposal, ell

    def _propose(self, anchors: torch.Tensor, seeds: torch.Tensor, rounds: torch.Tensor) -> tuple:
        """The drafter's round on the device: propose, confidences, calibration (capturable when
        the drafter is). Returns the proposal's tensors (:func:`_proposal`)."""
        drafter, session = self.drafter, self._session
        assert drafter is not None and session is not None  # a drafted round of a running batch
        state = session.dstate
        sampler = RoundSampler(self.config, seeds, rounds, self.config.block_size)
        proposal = drafter.propose(state, anchors, self.config.block_size, sampler)
        if proposal.confidence is None:
            proposal.confidence = drafter.confidence(state, proposal)
        if drafter.calibration is not None:  # the one place it is applied, the fit for the rule that verifies
            proposal.confidence = drafter.calibration.apply(proposal.confidence, self._chain_rule(proposal.draft_probs is not None))
        tree = proposal.tree
        tree_fields = (None,) * 4 if tree is None else (tree.tokens, tree.parents, tree.num_nodes, tree.draft_probs)
        return (proposal.tokens, proposal.lengths, proposal.draft_probs, proposal.confidence, *tree_fields,
                tree.fanout if tree is not None else None)

    def _verify_chain(self, rows: _Rows, proposal: Proposal | None, ell: torch.Tensor, most: int, padded: int):
        """2.-3. verify [anchor, x_1..x_W] per row (W: the widest ℓ this round can have) in one
        static step: target forward, acceptance, target commit."""
        cfg, R = self.config, len(rows.active)
        if proposal is None:
            width = 0
        elif reads_free(ell):
            width = int(ell.max())  # exact on a CPU: a trimmed verify costs less there
        else:
            width = min(proposal.tokens.shape[1], most)
        grid = rows.anchors[:, None]  # [R, 1 + W]: anchor, then the verified drafts
        q = None
        if width:
            assert proposal is not None  # width > 0 only with drafts
            drafts = proposal.tokens[:, :width].clamp(min=0)  # PAD past a row's drafts: a token the masks ignore
            grid = torch.cat([grid, drafts.to(grid.dtype)], dim=1)
            if proposal.draft_probs is not None and not cfg.greedy:
                q = proposal.draft_probs[:, :width]
        if width:  # the rule this round's drafts are verified by (counted on the host: a replay runs no Python)
            method = cfg.chain_verify if q is not None else "token"  # one-hot drafts: block = token in law
            self._count_rule("greedy" if cfg.greedy else method)
        else:
            method = "token"
        batch = rows.batch
        window = batch.window(width + 1, self.graphs.window())
        dense = self.target.dense(batch, width + 1, window)
        live = torch.ones(R, dtype=torch.bool, device=grid.device)
        inputs = [grid, ell, rows.seeds, rows.rounds, live] + ([q] if q is not None else [])

        def step(grid, ell, seeds, rounds, live, q=None):
            logits, taps = self.target.score(batch, grid, None, window, dense, upcast=self._inverse_cdf)
            self._mark()
            res = self._accept(logits, grid, ell, q, seeds, rounds, method)
            self._mark()
            keep = torch.where(live, res.accepted + 1, 0)
            self.target.keep(batch, keep)
            return res.accepted, res.tokens, keep, taps

        key = ("chain", padded, width, window, dense, q is not None, method, self._sampling(), batch.generation)
        accepted, tokens, keep, taps = rows.runner(key, step, inputs, padded, role="verify")
        batch.bound(width + 1)
        res = VerifyResult(accepted=accepted, tokens=tokens, num_tokens=accepted + 1)
        hidden = taps if batch.layer_ids else None
        return res, grid, keep, hidden

    def _accept(self, logits, grid, ell, q, seeds, rounds, method: str) -> VerifyResult:
        """Accept a prefix of each row's drafts by ``method`` ("token" or "block"): logits
        [n, 1 + W, V] (float; on CUDA the model's dtype) of grid [n, 1 + W] (anchor, drafts),
        ℓ [n]; q [n, W, V] or None (one-hot drafts). The grid verifiers' "auto" backend: the
        Triton kernels on CUDA (final token by the exponential race; with temperature alone they
        read the logits, no probabilities written), the torch reference on a CPU (final token by
        the inverse CDF)."""
        cfg = self.config
        width = grid.shape[1] - 1
        base = rounds * ROUND_STRIDE  # [n]
        if width == 0:  # no row verifies a draft: a plain decoding step (the same token verify would give)
            return _plain_step(self._sample(logits[:, 0], seeds, base, NOISE_SALT))
        drafts = grid[:, 1:]
        if cfg.greedy:
            return verify_greedy_grid(logits, drafts, ell)
        n, _, vocab = logits.shape
        col = torch.arange(width + 1, device=base.device)
        salts = torch.where(col == 0, NOISE_SALT, ENGINE_COIN_SALT)  # final draw at base, draft k's coin at base + k
        u = sampling.uniform(seeds[:, None], base[:, None] + col, salt=salts)  # [n, 1 + W]
        noise = CounterNoise(seeds, base, NOISE_SALT)  # exponential(seeds, base, V, NOISE_SALT), made where it is used
        if not self._inverse_cdf and cfg.top_k == 0 and cfg.top_p == 1 and self.observe is None:
            return verify_chain_logits_grid(logits, drafts, q, ell, temperature=cfg.temperature, method=method,
                                            uniforms=u[:, 1:], noise=noise)
        probs = sampling.logits_to_probs(logits.flatten(0, 1), cfg.temperature, cfg.top_k, cfg.top_p).view(n, -1, vocab)
        if self.observe is not None and q is not None:  # an observer sees the probabilities the rule reads
            self.observe(VerifyStep(method, probs, drafts, q, num_draft=ell))
        if self._inverse_cdf:
            return verify_chain_grid(probs, drafts, q, ell, method=method, uniforms=u[:, 1:], final_uniforms=u[:, 0])
        return verify_chain_grid(probs, drafts, q, ell, method=method, uniforms=u[:, 1:], noise=noise)

    def _verify_tree(self, rows: _Rows, proposal: Proposal, ell: torch.Tensor, padded: int):
        """Verify one draft tree per row in one static step: the configured rule for sampled
        siblings (``tree_verify``: "sampled" or "traversal") when the tree carries draft
        probabilities and T > 0, else the sample-and-match walk; then the accepted path enters the target cache. A row verifying
        nothing (token budget spent) gets an empty tree: its token is then the root's sample, the
        one a plain step would give (so outputs do not depend on the batch)."""
        cfg, R = self.config, len(rows.active)
        tree = proposal.tree
        assert tree is not None  # a tree round
        col = torch.arange(tree.parents.shape[1], device=ell.device)
        nodes = (tree.parents >= 0) & (col < tree.num_nodes[:, None]) & (ell[:, None] > 0)  # [R, N]
        parents = torch.where(nodes, tree.parents, -1)
        ids = torch.cat([rows.anchors[:, None], tree.tokens.clamp(min=0).to(rows.anchors.dtype)], dim=1)  # [R, N+1]
        grid_parents = torch.cat([torch.full_like(parents[:, :1], -1), parents], dim=1)
        q = tree.draft_probs if tree.draft_probs is not None and not cfg.greedy else None
        method = "match" if q is None else cfg.tree_verify
        self._count_rule(method)
        fanout = 0 if q is None else tree.fanout if tree.fanout is not None else _fanout(parents)
        depth = cfg.block_size
        batch = rows.batch
        window = batch.window(ids.shape[1], self.graphs.window())
        live = torch.ones(R, dtype=torch.bool, device=ids.device)
        inputs = [ids, grid_parents, rows.seeds, rows.rounds, live] + ([q] if q is not None else [])

        def step(ids, grid_parents, seeds, rounds, live, q=None):
            logits, taps = self.target.score(batch, ids, grid_parents, window, upcast=self._inverse_cdf)
            self._mark()
            n, width, vocab = logits.shape
            probs = sampling.logits_to_probs(logits.flatten(0, 1), cfg.temperature, cfg.top_k, cfg.top_p)
            if self.observe is not None and q is not None:
                self.observe(VerifyStep(method, probs.view(n, width, vocab), ids[:, 1:], q,
                                        parents=grid_parents[:, 1:], depth=depth, fanout=fanout))
            res = verify_tree_grid(
                probs.view(n, width, vocab), ids[:, 1:], grid_parents[:, 1:], depth=depth, fanout=fanout,
                method=method, draft_probs=q, seeds=seeds, offsets=rounds * ROUND_STRIDE,
                final_draw="inverse_cdf" if self._inverse_cdf else "race",
            )  # fmt: skip
            self._mark()
            assert res.path is not None  # tree verification returns the accepted path
            path = torch.where(live[:, None], res.path, -1)
            self.target.keep_path(batch, path)
            keep = torch.where(live, res.accepted + 1, 0)
            on_path = path.clamp(min=0)  # [n, D+1]: root (the anchor), then the accepted nodes
            committed = ids.gather(1, on_path)
            hidden = taps.gather(1, on_path[..., None].expand(n, on_path.shape[1], taps.shape[2]))
            return res.accepted, res.tokens, keep, committed, hidden

        key = ("tree", padded, ids.shape[1], window, method, fanout, self._sampling(), batch.generation)
        accepted, tokens, keep, committed, hidden = rows.runner(key, step, inputs, padded, role="verify")
        batch.bound(depth + 1)
        res = VerifyResult(accepted=accepted, tokens=tokens, num_tokens=accepted + 1)
        return res, committed, keep, hidden if batch.layer_ids else None, nodes.sum(1)

    def _advance(self, rows: _Rows, committed, keep, hidden, padded: int) -> None:
        """3. the drafter's cache takes the committed tokens (anchor + accepted drafts) of every row."""
        drafter = self.drafter
        assert drafter is not None  # called with a drafter only
        key = drafter.capture_key(rows.dstate, self.graphs.window())
        if key is None:  # eagerly, unpadded
            R = len(rows.active)
            drafter.advance_grid(rows.dstate, committed[:R], keep[:R], None if hidden is None else hidden[:R])
            return
        inputs = [committed, keep] + ([hidden] if hidden is not None else [])

        def step(committed, keep, hidden=None):
            drafter.advance_grid(rows.dstate, committed, keep, hidden)

        rows.runner(("advance", padded, committed.shape[1], key), step, inputs, padded, role="advance")

    def _mark(self) -> None:
        """A phase boundary inside a verify step (recorded when the step runs eagerly)."""
        if not torch.compiler.is_compiling():
            self._marks.append(time.perf_counter())

    def _phase_marks(self, t1: float) -> tuple[float, float]:
        """(end of the target forward, end of acceptance): measured when the step ran eagerly; a
        replayed graph has no phases on the host (all counts as forward)."""
        now, marks = time.perf_counter(), self._marks
        self._marks = []
        if len(marks) >= 2:
            return marks[-2], marks[-1]
        return now, now

    def _book(self, rows, results, res, proposal, verified, times: tuple[float, ...]) -> None:
        """Per-request statistics and outputs of one round, from the round's one read of the
        device. ``verified`` [R]: drafts (tree nodes) verified per row; ``times``: perf_counter at
        the round's start, after drafting, the target forward, acceptance and the cache update."""
        t0, t1, tf, ta, t2 = times
        R = len(rows.active)
        conf = proposal.confidence if proposal is not None else None
        gamma = 0 if conf is None else conf.shape[1]
        columns = [res.accepted[:R, None], verified[:, None],
                   proposal.lengths[:, None] if proposal is not None else verified[:, None], res.tokens[:R]]
        columns += [conf] if conf is not None else []
        read = torch.cat([c.double() for c in columns], dim=1).tolist()  # the round's one host read
        width = res.tokens.shape[1]
        acc_total = verify_tokens = 0
        for r, i in enumerate(rows.active):
            row = read[r]
            acc, ell_r = int(row[0]), int(row[1])
            res_i = results[i]
            res_i.output_ids.extend(int(t) for t in row[3 : 3 + acc + 1])
            res_i.verified.append(ell_r)
            res_i.accepted.append(acc)
            res_i.proposed.append(int(row[2]) if proposal is not None else 0)
            res_i.confidence.append(row[3 + width : 3 + width + gamma][:ell_r] if conf is not None else [])
            acc_total += acc
            verify_tokens += ell_r + 1
        lengths = [len(results[i].prompt_ids) + len(results[i].output_ids) - 1 for i in rows.active]
        rows.batch.settle(lengths)
        if self.drafter is not None:
            self.drafter.settle(rows.dstate, lengths)
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
        self.scheduler.observe_round(R, t3 - t0, proposal is not None, R + acc_total, rows.catch_up)
        rows.catch_up = 0.0

    def _retire(self, rows: _Rows, results: list[RequestResult], on_finish) -> None:
        """Finished requests leave the batch (stop token or max_new_tokens); the last rows move
        into their places (a copy of the moved rows only)."""
        done = []
        for r, i in enumerate(rows.active):
            res = results[i]
            reason = self._truncate(res)
            if reason:
                res.finish_reason = reason
                done.append(r)
        if not done:
            return
        order = _fill_holes(len(rows.active), set(done), rows.lag.admitted if self.drafter is not None else len(rows.active))
        self.target.select_rows(rows.batch, order)
        if self.drafter is not None:
            rows.lag.keep(self.drafter, rows.dstate, order)
        idx = torch.tensor(order, dtype=torch.long, device=rows.anchors.device)
        rows.anchors, rows.seeds, rows.rounds = rows.anchors[idx], rows.seeds[idx], rows.rounds[idx]
        rows.produced = rows.produced[idx]
        finished = [rows.active[r] for r in done]
        rows.active = [rows.active[r] for r in order]
        now = time.perf_counter()
        for i in finished:
            results[i].end_time = now
        if on_finish is not None:
            for i in finished:
                on_finish(results[i])

    # -- helpers -------------------------------------------------------------------------
    def _sampling(self) -> tuple:
        """What a captured propose or verify step bakes in besides shapes: the sampling settings."""
        c = self.config
        return c.temperature, c.top_k, c.top_p, c.block_size

    def _count_rule(self, rule: str) -> None:
        self.stats.verify_rules[rule] = self.stats.verify_rules.get(rule, 0) + 1

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
        """One target token per row from logits [R, V] at the run's settings: the inverse CDF on a
        CPU, else the exponential race of :func:`sample_logits` (Triton on CUDA: the noise is
        computed where it is used, never written)."""
        cfg = self.config
        if cfg.greedy:
            return logits.argmax(-1)
        if self._inverse_cdf:
            probs = sampling.logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
            return sampling.sample_inverse_cdf(probs, sampling.uniform(seeds, offsets, salt=salt))
        return sample_logits(logits, seeds, offsets, salt=salt, temperature=cfg.temperature, top_k=cfg.top_k,
                             top_p=cfg.top_p)

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


def _proposal(fields: tuple, rows: int) -> Proposal:
    """The Proposal of :meth:`SpeculativeEngine._propose`'s tensors, cut to the batch's rows."""
    tokens, lengths, probs, conf, t_tokens, t_parents, t_nodes, t_probs = (
        f[:rows] if isinstance(f, torch.Tensor) else f for f in fields[:-1]
    )
    fanout = fields[-1]  # a host int (or None), never cut
    tree = None if t_tokens is None else DraftTree(t_tokens, t_parents, t_nodes, t_probs, fanout=fanout)
    return Proposal(tokens=tokens, lengths=lengths, draft_probs=probs, confidence=conf, tree=tree)


def _fanout(parents: torch.Tensor) -> int:
    """The most children of any node of trees parents [R, N] (-1: no node): one host read, for
    drafters whose trees do not state it (:attr:`DraftTree.fanout`)."""
    R, N = parents.shape
    counts = torch.zeros(R, N + 1, dtype=torch.long, device=parents.device)
    counts.scatter_add_(1, parents.clamp(min=0), (parents >= 0).long())
    return int(counts.max()) if counts.numel() else 0


def _fill_holes(rows: int, done: set[int], admitted: int) -> list[int]:
    """The rows that stay, in their new order (old row of each new row): rows that finished leave
    holes, filled by the last rows, so only those move. Rows before ``admitted`` (the drafter has
    them) stay before the others (DrafterLag's pending admissions stay a suffix)."""
    order: list[int] = []
    for lo, hi in ((0, admitted), (admitted, rows)):
        kept = [r for r in range(lo, hi) if r not in done]
        start, end = len(order), len(order) + len(kept)
        movers = iter(r for r in kept if not start <= r < end)
        order += [r if r in kept else next(movers) for r in range(start, end)]
    return order


def _plain_step(tokens: torch.Tensor) -> VerifyResult:
    """The verify result of a round without drafts: one sampled token per row."""
    zero = torch.zeros_like(tokens)
    return VerifyResult(accepted=zero, tokens=tokens[:, None], num_tokens=zero + 1)


@dataclass
class _Session:
    """What an engine keeps across generate calls: the target's KV cache, the drafter's state and
    the graphs captured over them."""

    batch: TargetBatch
    dstate: Any  # the drafter's DraftState; None without a drafter
    runner: GraphRunner


@dataclass
class _Rows:
    """The running batch: target cache, drafter state and per-row tensors, in row order."""

    batch: TargetBatch
    dstate: Any  # the drafter's DraftState; None without a drafter
    device: torch.device
    runner: GraphRunner
    active: list[int] = field(default_factory=list)  # request index per row
    lag: DrafterLag = field(default_factory=DrafterLag)  # what the drafter has not seen yet
    catch_up: float = 0.0  # seconds this round's lag hand-over took

    def __post_init__(self) -> None:
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        self.anchors = empty  # [R] last sampled token, not yet in the target cache
        self.seeds = empty  # [R] per-request seed
        self.rounds = empty  # [R] per-request round counter (randomness key)
        self.produced = empty  # [R] tokens generated so far (= len(output_ids) before truncation)
