"""Target: ragged batched verify / trees / commits / row moves equal plain full forwards."""

from __future__ import annotations

import pytest
import torch

from dspec_cli.core.errors import DspecError
from dspec_cli.runtime import target as target_mod
from dspec_cli.runtime.target import Target
from tests.tiny_models import (
    FACTORIES,
    VOCAB_SIZE,
    tiny_gemma3,
    tiny_qwen3,
    tiny_target,
    tiny_tokenizer,
)

LAYERS = (-1, 0, 2)
ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def target(request) -> Target:
    return tiny_target(request.param)


class Session:
    """A batch plus the reference token sequence (committed tokens) of every row."""

    def __init__(self, target: Target, seed: int, **batch_kwargs):
        self.t = target
        self.gen = torch.Generator().manual_seed(seed)
        self.batch = target.new_batch(LAYERS, **batch_kwargs)
        self.seqs: list[list[int]] = []
        self.anchors: list[int] = []

    def rand(self, n: int) -> list[int]:
        return torch.randint(VOCAB_SIZE, (n,), generator=self.gen).tolist()

    def randint(self, low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=self.gen))

    def check(self, out_logits, out_hidden, seq: list[int], new: list[int]) -> None:
        logits, taps = self.t.forward_full(torch.tensor([seq + new]), LAYERS)
        torch.testing.assert_close(out_logits, logits[len(seq) :], atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(out_hidden, taps[len(seq) :], atol=ATOL, rtol=ATOL)

    def prefill(self, lens: list[int]) -> None:
        self.prefill_prompts([self.rand(n) for n in lens])

    def prefill_prompts(self, prompts: list[list[int]]) -> None:
        out = self.t.prefill(self.batch, prompts)
        first = len(self.seqs)
        assert out.rows.tolist() == list(range(first, first + len(prompts)))
        assert out.logits.shape == (len(prompts), VOCAB_SIZE)
        for r, p in enumerate(prompts):
            assert out.hidden[r].shape == (len(p), 3 * self.t.hidden_size)
            logits, taps = self.t.forward_full(torch.tensor([p]), LAYERS)
            torch.testing.assert_close(out.logits[r], logits[-1], atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(out.hidden[r], taps, atol=ATOL, rtol=ATOL)
        self.seqs += prompts
        self.anchors += self.rand(len(prompts))

    def sizes(self, most: int) -> list[int]:
        """Tokens per row in 1..most; now and then a row sits the step out (0), never all rows."""
        sizes = [0 if self.randint(0, 5) == 0 else self.randint(1, most + 1) for _ in self.seqs]
        return sizes if any(sizes) else [1] * len(sizes)

    def chain_round(self, max_len: int = 4) -> None:
        chains = [[self.anchors[r]] + self.rand(n - 1) if n else [] for r, n in enumerate(self.sizes(max_len + 1))]
        lengths = torch.tensor([len(c) for c in chains])
        out = self.t.verify(self.batch, torch.tensor(sum(chains, [])), lengths)
        assert out.rows.tolist() == sum(([r] * len(c) for r, c in enumerate(chains)), [])
        off = 0
        for r, chain in enumerate(chains):
            k = len(chain)
            self.check(out.logits[off : off + k], out.hidden[off : off + k], self.seqs[r], chain)
            off += k
        keep = [self.randint(1, len(c) + 1) if c else 0 for c in chains]
        self.t.commit(self.batch, torch.tensor(keep))
        for r, chain in enumerate(chains):
            if chain:
                self.seqs[r] += chain[: keep[r]]
                self.anchors[r] = self.rand(1)[0]

    def tree_round(self, max_nodes: int = 7) -> None:
        rows = len(self.seqs)
        sizes = self.sizes(max_nodes)
        parents = [[-1] + [self.randint(0, i) for i in range(1, n)] if n else [] for n in sizes]
        toks = [[self.anchors[r]] + self.rand(n - 1) if n else [] for r, n in enumerate(sizes)]
        out = self.t.verify_tree(
            self.batch, torch.tensor(sum(toks, [])), torch.tensor(sum(parents, [])), torch.tensor(sizes)
        )

        def path_to(r: int, node: int) -> list[int]:
            path = [node]
            while parents[r][path[-1]] >= 0:
                path.append(parents[r][path[-1]])
            return path[::-1]

        off = 0
        for r in range(rows):
            for node in range(sizes[r]):
                new = [toks[r][i] for i in path_to(r, node)]
                i = off + node
                self.check(out.logits[i : i + 1], out.hidden[i : i + 1], self.seqs[r] + new[:-1], new[-1:])
            off += sizes[r]
        paths = [path_to(r, self.randint(0, sizes[r])) if sizes[r] else [] for r in range(rows)]
        depth = max(len(p) for p in paths) + 1
        padded = torch.tensor([p + [-1] * (depth - len(p)) for p in paths])
        self.t.commit_path(self.batch, padded)
        for r, p in enumerate(paths):
            if p:
                self.seqs[r] += [toks[r][i] for i in p]
                self.anchors[r] = self.rand(1)[0]

    def append_round(self, max_len: int = 4) -> None:
        """Target.append: ragged chains (>= 1 token per row) are committed; last-token logits."""
        chains = [[self.anchors[r]] + self.rand(self.randint(0, max_len)) for r in range(len(self.seqs))]
        flat = torch.tensor([t for c in chains for t in c])
        logits = self.t.append(self.batch, flat, torch.tensor([len(c) for c in chains]))
        assert logits.shape == (len(chains), VOCAB_SIZE)
        for r, chain in enumerate(chains):
            full, _ = self.t.forward_full(torch.tensor([self.seqs[r] + chain]))
            torch.testing.assert_close(logits[r], full[-1], atol=ATOL, rtol=ATOL)
            self.seqs[r] += chain
            self.anchors[r] = self.rand(1)[0]

    def rollback(self) -> None:
        drop = [self.randint(0, min(4, len(s))) for s in self.seqs]
        self.t.rollback(self.batch, torch.tensor(drop))
        self.seqs = [s[: len(s) - d] for s, d in zip(self.seqs, drop, strict=True)]

    def assert_committed(self) -> None:
        assert self.batch.committed.tolist() == [len(s) for s in self.seqs]
        assert self.batch.lengths == [len(s) for s in self.seqs] and self.batch.exact


def test_ragged_chains_match_full_forward(target):
    s = Session(target, seed=1)
    s.prefill([5, 11, 3])
    for _ in range(5):
        s.chain_round()
    s.assert_committed()


def test_trees_then_chains_match_full_forward(target):
    s = Session(target, seed=2)
    s.prefill([4, 9, 6])
    s.tree_round()
    s.chain_round()
    s.tree_round()
    s.chain_round()
    s.assert_committed()


def test_row_moves_and_continuous_batching(target):
    """Rows leave (order kept, or reordered by select_rows), join mid-stream and outgrow the
    first allocation; only rows that change place are copied."""
    s = Session(target, seed=3, slots=8)
    s.prefill([7, 2, 10])
    s.chain_round()
    s.tree_round()
    s.rollback()
    s.chain_round()
    target.remove(s.batch, [1])
    del s.seqs[1], s.anchors[1]
    s.prefill([6])  # a new request joins mid-stream
    for _ in range(2):
        s.chain_round()
    target.remove(s.batch, [0, 2])
    s.seqs, s.anchors = s.seqs[1:2], s.anchors[1:2]
    s.prefill([3, 8])
    s.chain_round()
    s.assert_committed()
    target.select_rows(s.batch, [2, 0, 1])  # the last row fills the first place
    s.seqs, s.anchors = [s.seqs[i] for i in (2, 0, 1)], [s.anchors[i] for i in (2, 0, 1)]
    s.chain_round()
    s.tree_round()
    s.assert_committed()
    assert s.batch.generation > 1  # the 8 slots first allocated were outgrown


def test_prefill_groups_and_duplicates(target, monkeypatch):
    """Mixed lengths (several prefill groups, one a single row) with duplicates join mid-generation
    rows: rows come back in prompt order, each distinct prompt runs once, copies stay independent."""
    forwarded: list[int] = []
    group = Target._prefill_group

    def spy(self, batch, prompts):
        forwarded.extend(len(p) for p in prompts)
        return group(self, batch, prompts)

    monkeypatch.setattr(Target, "_prefill_group", spy)
    s = Session(target, seed=7)
    s.prefill([6, 2])
    s.chain_round()
    distinct = [s.rand(n) for n in (62, 3, 200, 9, 60, 4)]
    assert len(target_mod._length_groups([len(p) for p in distinct])) == 3
    forwarded.clear()
    order = [1, 2, 1, 0, 5, 1, 3, 4, 2]
    s.prefill_prompts([list(distinct[i]) for i in order])
    assert sorted(forwarded) == sorted(len(p) for p in distinct)
    for _ in range(2):
        s.chain_round()
        s.tree_round()
    s.append_round()
    s.assert_committed()
    assert len({tuple(q) for q in s.seqs}) == len(s.seqs)  # the copies went their own ways


@pytest.mark.parametrize("lens", [[5], [5, 11, 3]])
def test_append_and_single_row_steps_match_full_forward(target, lens, monkeypatch):
    """append (a drafter's own model), chains and rollbacks; one row takes the mask-free dense path."""
    dense = []
    real = Target.dense
    monkeypatch.setattr(Target, "dense", lambda self, *a: dense.append(real(self, *a)) or dense[-1])
    s = Session(target, seed=6)
    s.prefill(lens)
    for _ in range(3):
        s.append_round()
        s.chain_round()
        s.rollback()
    s.assert_committed()
    assert any(dense) == (len(lens) == 1)


def test_static_steps_read_nothing_and_match_full_forward(target):
    """The engine's level: score padded grids (rows past the batch are padding), keep / keep_path
    on the device, settle the host lengths afterwards; windows rounded up to a bucket."""
    s = Session(target, seed=8, rows=4)
    s.prefill([6, 3])
    t, batch = s.t, s.batch
    for step in range(3):
        q = 3
        chains = [[s.anchors[r]] + s.rand(q - 1) for r in range(2)]
        ids = torch.tensor(chains + [[0] * q, [0] * q])  # two padding rows
        window = batch.window(q, bucket=16)
        assert window % 16 == 0
        logits, taps = t.score(batch, ids, None, window)
        for r in range(2):
            s.check(logits[r], taps[r], s.seqs[r], chains[r])
        keep = torch.tensor([1 + step % 3, 2, 0, 0])
        t.keep(batch, keep)
        batch.bound(q)
        assert not batch.exact
        for r in range(2):
            s.seqs[r] += chains[r][: int(keep[r])]
            s.anchors[r] = s.rand(1)[0]
        batch.settle([len(x) for x in s.seqs])
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -1]])  # row 1: node 3 is padding
    toks = [[s.anchors[r]] + s.rand(3) for r in range(2)]
    logits, taps = t.score(batch, torch.tensor(toks), parents, batch.window(4, bucket=16))
    s.check(logits[0, 3:], taps[0, 3:], s.seqs[0] + [toks[0][0], toks[0][1]], toks[0][3:])
    t.keep_path(batch, torch.tensor([[0, 2], [0, 1]]))
    s.seqs[0] += [toks[0][0], toks[0][2]]
    s.seqs[1] += toks[1][:2]
    batch.settle([len(x) for x in s.seqs])
    s.assert_committed()
    s.anchors = s.rand(2)
    s.chain_round()


def test_eager_attention_matches_full_forward():
    model = tiny_qwen3()
    model.set_attn_implementation("eager")
    s = Session(Target(model), seed=5)
    s.prefill([4, 8])
    s.chain_round()
    s.tree_round()


def test_bad_input_raises():
    t = Target(tiny_qwen3())
    with pytest.raises(ValueError, match="layer_ids"):
        t.new_batch([3])
    batch = t.new_batch()
    with pytest.raises(ValueError, match="no rows"):
        t.verify(batch, torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="prompts"):
        t.prefill(batch, [[1, 2], []])
    t.prefill(batch, [[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match="lengths"):
        t.verify(batch, torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="lengths"):
        t.verify(batch, torch.tensor([], dtype=torch.long), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="tokens"):
        t.verify(batch, torch.tensor([1, 2]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="at least one token"):
        t.append(batch, torch.tensor([1, 2]), torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="nothing to commit"):
        t.commit(batch, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="parents"):
        t.verify_tree(batch, torch.tensor([1, 2, 3]), torch.tensor([-1, 1, -1]), torch.tensor([2, 1]))
    t.verify(batch, torch.tensor([1, 2, 3]), torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="not been committed"):
        t.verify(batch, torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="keep"):
        t.commit(batch, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="commit_path cannot follow verify"):
        t.commit_path(batch, torch.tensor([[0], [0]]))
    t.commit(batch, torch.tensor([2, 1]))
    t.verify_tree(batch, torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 0, -1]), torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="path"):
        t.commit_path(batch, torch.tensor([[0, 1, 2], [0, -1, -1]]))
    with pytest.raises(ValueError, match="path"):
        t.commit_path(batch, torch.tensor([[0, -1, 2], [0, -1, -1]]))
    with pytest.raises(ValueError, match="path"):
        t.commit_path(batch, torch.tensor([[0, 9], [0, -1]]))
    with pytest.raises(ValueError, match="not been committed"):
        t.remove(batch, [0])
    t.commit_path(batch, torch.tensor([[0, 2], [0, -1]]))
    assert batch.committed.tolist() == [7, 4]
    with pytest.raises(ValueError, match="drop"):
        t.rollback(batch, torch.tensor([8, 0]))
    t.rollback(batch, torch.tensor([2, 0]))
    assert batch.committed.tolist() == [5, 4] and batch.lengths == [5, 4]
    with pytest.raises(ValueError, match="rows"):
        t.remove(batch, [2])
    t.remove(batch, [0, 1])
    assert batch.num_rows == 0 and batch.committed.numel() == 0


def test_render_prompt_chatml():
    tok = tiny_tokenizer()
    t = Target(tiny_qwen3(), tok)
    ids = t.render_prompt("hello there")
    assert tok.decode(ids) == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.decode(t.render_prompt(msgs)).startswith("<|im_start|>system\nbe brief<|im_end|>\n")
    plain = Target(tiny_qwen3(), tok, chat_template=False)
    assert plain.render_prompt("hello there") == tok.encode("hello there")
    with pytest.raises(ValueError, match="message list"):
        plain.render_prompt(msgs)
    assert tok.eos_token_id in t.eos_token_ids


def test_load_local_and_default(tmp_path, monkeypatch):
    model, tok = tiny_qwen3(), tiny_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    t = Target.load(str(tmp_path / "m"), dtype="float32")
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(t.forward_full(ids)[0], Target(model).forward_full(ids)[0])
    assert t.render_prompt("hi") == Target(model, tok).render_prompt("hi")
    assert not any(p.requires_grad for p in t.model.parameters())
    monkeypatch.setattr(target_mod, "DEFAULT_TARGET_PATH", tmp_path / "missing")
    with pytest.raises(DspecError, match="missing"):
        Target.load()
    with pytest.raises(DspecError, match="cannot load target"):
        Target.load(str(tmp_path / "nope"))
    with pytest.raises(DspecError, match="dtype"):
        Target.load(str(tmp_path / "m"), dtype="float33")


def test_grouped_query_attention_stacks_query_heads_instead_of_copying_the_cache():
    """Target switches sdpa models to dspec_sdpa: for several query tokens under a bool mask the
    query heads of a KV head are stacked along the query axis (no K/V copy); the output equals
    transformers' sdpa (which repeats K/V per head), and every other call is transformers' own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dspec_cli.runtime import attention

    t = Target(tiny_qwen3())
    assert t.model.config._attn_implementation == attention.NAME
    module = t.model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    for q_len, mask in [(5, True), (1, True), (5, False)]:
        query = torch.randn(2, 4, q_len, 16, generator=gen)
        key, value = torch.randn(2, 2, 9, 16, generator=gen), torch.randn(2, 2, 9, 16, generator=gen)
        m = torch.rand(2, 1, q_len, 9, generator=gen) < 0.7 if mask else None
        if m is not None:
            m[..., 0] = True  # no empty rows
        got, _ = attention._attention(module, query, key, value, m, scaling=0.25)
        want, _ = sdpa_attention_forward(module, query, key, value, m, scaling=0.25)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    eager = tiny_qwen3()
    eager.set_attn_implementation("eager")
    assert not attention.use_for(eager) and eager.config._attn_implementation == "eager"


@pytest.mark.parametrize("factory,masks", [(tiny_qwen3, 1), (tiny_gemma3, 2)])  # gemma3: full and sliding layers
def test_masked_steps_read_the_cache_in_place_with_one_mask_per_forward(monkeypatch, factory, masks):
    """Every SDPA call of a static step (one query token or several, under a mask or not) reads
    the slot cache's own K/V buffers with the cache's head count: no step copies K/V per head,
    whatever transformers does for one query token. The layers of one forward share one mask
    (stacked once for several query tokens; for one, the step's mask or, on the dense path,
    transformers' own), one per layer type."""
    import torch.nn.functional as F

    calls: list[tuple] = []
    real = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((key, attn_mask, kwargs.get("enable_gqa", False)))
        return real(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    t = Target(factory())
    kv_heads = t.config.num_key_value_heads
    for rows, lens in ((3, [6, 3, 9]), (1, [5])):
        batch = t.new_batch(rows=4, slots=64)
        t.prefill(batch, [list(range(1, n + 1)) for n in lens])
        buffers = {buf.untyped_storage().data_ptr() for layer in batch.cache.kv_layers() for buf in layer.kv()}
        for q in (1, 4):
            for dense in (False, True) if rows == 1 else (False,):
                calls.clear()
                window = batch.window(q, bucket=1 if dense else 16)
                assert t.dense(batch, q, window) == dense
                t.score(batch, torch.ones(rows if dense else 4, q, dtype=torch.long), None, window, dense)
                assert len(calls) == t.num_layers
                for key, mask, gqa in calls:
                    assert key.shape[1] == kv_heads and key.untyped_storage().data_ptr() in buffers
                    assert not (gqa and mask is not None)  # enable_gqa under a mask: CUDA's math kernel
                assert len({id(mask) for _, mask, _ in calls}) <= masks, (rows, q, dense)
