"""Target: ragged batched verify / trees / commits / compaction equal plain full forwards."""

from __future__ import annotations

import pytest
import torch

from dspec_cli.core.errors import DspecError
from dspec_cli.runtime import target as target_mod
from dspec_cli.runtime.target import Target
from tests.tiny_models import (
    FACTORIES,
    VOCAB_SIZE,
    tiny_qwen3,
    tiny_target,
    tiny_tokenizer,
)

LAYERS = (-1, 0, 2)
ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def target(request) -> Target:
    return tiny_target(request.param)


@pytest.fixture(params=["concat", "slack"])
def kv_append(request, monkeypatch):
    """Both ways a cache layer appends (tiny models are all under the concatenation threshold)."""
    from dspec_cli.runtime.kv_cache import SlackLayer

    monkeypatch.setattr(SlackLayer, "SMALL", 1 << 62 if request.param == "concat" else 0)
    return request.param


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
        assert self.batch.valid.sum(1).tolist() == [len(s) for s in self.seqs]


def test_ragged_chains_match_full_forward(target, kv_append):
    s = Session(target, seed=1, compact_fraction=1.0)
    s.prefill([5, 11, 3])
    for _ in range(5):
        s.chain_round()
    s.assert_committed()
    assert s.batch.holes > 0 and s.batch.num_compactions == 0


def test_trees_then_chains_match_full_forward(target, kv_append):
    s = Session(target, seed=2, compact_fraction=1.0)
    s.prefill([4, 9, 6])
    s.tree_round()
    s.chain_round()
    s.tree_round()
    s.chain_round()
    s.assert_committed()


def test_compaction_and_continuous_batching(target, kv_append):
    s = Session(target, seed=3, compact_fraction=0.1)
    s.prefill([7, 2, 10])
    s.chain_round()
    s.tree_round()
    s.rollback()
    s.chain_round()
    assert s.batch.num_compactions > 0
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
    s.batch.compact()
    lens = [len(q) for q in s.seqs]
    assert s.batch.num_slots == max(lens) and s.batch.holes == len(lens) * max(lens) - sum(lens)
    packed = torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]
    assert torch.equal(s.batch.valid, packed)
    s.chain_round()


def test_prefill_groups_and_duplicates(target, monkeypatch):
    """Mixed lengths (several prefill groups, one a single row) with duplicates join mid-generation
    rows: rows come back in prompt order, each distinct prompt runs once, copies stay independent."""
    forwarded: list[int] = []
    group = Target._prefill_group

    def spy(self, batch, prompts):
        forwarded.extend(len(p) for p in prompts)
        return group(self, batch, prompts)

    monkeypatch.setattr(Target, "_prefill_group", spy)
    s = Session(target, seed=7, compact_fraction=0.5)
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
def test_append_and_single_row_steps_match_full_forward(target, lens, kv_append):
    """append (a drafter's own model), chains and rollbacks; one row takes the mask-free dense path."""
    s = Session(target, seed=6)
    s.prefill(lens)
    for _ in range(3):
        s.append_round()
        s.chain_round()
        s.rollback()
    s.assert_committed()
    if len(lens) == 1:
        assert s.batch.holes == 0  # rejected and rolled-back slots are cut off, never left as holes


def test_max_slots_bound_compacts():
    t = Target(tiny_qwen3())
    s = Session(t, seed=4, compact_fraction=1.0, max_slots=16)
    s.prefill([3, 12])
    for _ in range(3):
        s.chain_round()
    assert s.batch.num_compactions > 0
    s.assert_committed()


def test_slack_layer_appends_in_place_and_keeps_dynamic_semantics(monkeypatch):
    """Appending writes into spare slots (no copy of the cache while it fits); reads equal what
    concatenation gives; trimming shortens in place; assigning a new tensor replaces the buffer;
    small tensors are concatenated."""
    from dspec_cli.runtime.kv_cache import SlackLayer

    small = SlackLayer()
    small.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    keys, _ = small.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert keys.shape == (1, 2, 4, 4) and keys.is_contiguous()  # 64 bytes per slot: under SMALL
    monkeypatch.setattr(SlackLayer, "SMALL", 0)
    layer, ref = SlackLayer(), torch.zeros(2, 3, 0, 4)
    g = torch.Generator().manual_seed(0)
    ptrs = set()
    for q in (5, 1, 1, 7, 1):
        k = torch.randn(2, 3, q, 4, generator=g)
        keys, values = layer.update(k, -k)
        ref = torch.cat([ref, k], dim=2)
        assert torch.equal(keys, ref) and torch.equal(values, -ref) and torch.equal(layer.keys, ref)
        ptrs.add(layer.keys.data_ptr())
    assert len(ptrs) == 1 and layer.get_seq_length() == 15  # one buffer (5 + 64 spare slots)
    layer.keys, layer.values = layer.keys[:, :, :9], layer.values[:, :, :9]  # a trim: same buffer
    assert layer.keys.shape[2] == 9 and layer.keys.data_ptr() in ptrs
    layer.update(torch.ones(2, 3, 1, 4), torch.ones(2, 3, 1, 4))
    assert torch.equal(layer.keys[:, :, :9], ref[:, :, :9]) and torch.equal(layer.keys[:, :, 9], torch.ones(2, 3, 4))
    layer.keys = layer.keys.index_select(0, torch.tensor([1]))  # row selection: a new buffer
    assert layer.keys.shape == (1, 3, 10, 4) and layer.keys.data_ptr() not in ptrs
    layer.values = layer.values.index_select(0, torch.tensor([1]))
    keys, _ = layer.update(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4))  # grows by copying once
    assert torch.equal(keys[:, :, :9], ref[1:, :, :9]) and keys.shape[2] == 12


def test_eager_attention_matches_full_forward():
    model = tiny_qwen3()
    model.set_attn_implementation("eager")
    s = Session(Target(model), seed=5, compact_fraction=1.0)
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
    assert batch.committed.tolist() == [5, 4] and batch.valid.sum(1).tolist() == [5, 4]
    with pytest.raises(ValueError, match="rows"):
        t.remove(batch, [2])
    t.remove(batch, [0, 1])
    assert batch.num_rows == 0 and batch.num_slots == 0


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


def test_kv_cache_benchmark_runs_both_layer_kinds():
    """The micro-benchmark times both layer kinds, and batches are made of the kind asked for."""
    from benchmarks import kv_cache

    layers = []
    real = kv_cache.decode_seconds

    def spy(target, ids, steps, layer):
        layers.append(layer)
        return real(target, ids, steps, layer)

    kv_cache.decode_seconds = spy
    try:
        runs = kv_cache.measure(tiny_target("qwen3"), kv_cache.BUILTIN, [1, 3], steps=2, repeats=2)
    finally:
        kv_cache.decode_seconds = real
    assert [r["rows"] for r in runs] == [1, 3] and all(r["speedup"] > 0 and len(r["speedup_runs"]) == 2 for r in runs)
    assert set(layers) == set(kv_cache.KINDS.values())
    target = tiny_target("qwen3")
    for layer in kv_cache.KINDS.values():
        batch = target.new_batch((), kv_layer=layer)
        target.prefill(batch, [[1, 2, 3]])
        assert {type(x) for x in batch.cache.layers} == {layer}


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
