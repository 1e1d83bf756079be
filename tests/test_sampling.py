"""dspec_cli.core.sampling: temperature / top-k / top-p and counter-based randomness."""

import itertools

import pytest
import torch

from dspec_cli.core.sampling import (
    exponential,
    logits_to_probs,
    sample_from_probs,
    sample_inverse_cdf,
    torch_exponential,
    torch_uniform,
    uniform,
)


def _brute_force(logits_row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Per-row python reference of temperature -> top-k -> top-p (ties: lower id first)."""
    V = logits_row.numel()
    if temperature == 0:
        out = torch.zeros(V)
        out[int(logits_row.argmax())] = 1
        return out
    probs = torch.softmax(logits_row.float() / temperature, -1)
    order = sorted(range(V), key=lambda v: (-float(probs[v]), v))
    kept = order[: top_k if top_k > 0 else V]
    mass = sum(float(probs[v]) for v in kept)
    nucleus, acc = [], 0.0
    for v in kept:
        if top_p < 1 and acc >= top_p * mass:
            break
        nucleus.append(v)
        acc += float(probs[v])
    out = torch.zeros(V)
    out[nucleus] = probs[nucleus]
    return out / out.sum()


class TestLogitsToProbs:
    def test_rows_are_distributions(self):
        g = torch.Generator().manual_seed(0)
        probs = logits_to_probs(torch.randn(7, 33, generator=g), 0.7, top_k=5, top_p=0.9)
        assert probs.dtype == torch.float32
        assert torch.allclose(probs.sum(-1), torch.ones(7), atol=1e-6)
        assert (probs >= 0).all()

    def test_plain_softmax(self):
        logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
        assert torch.allclose(logits_to_probs(logits, 2.0), torch.softmax(logits / 2.0, -1))

    def test_greedy_is_one_hot_argmax_first_on_ties(self):
        logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
        probs = logits_to_probs(logits, 0.0, top_k=1, top_p=0.1)
        assert torch.equal(probs, torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))

    @pytest.mark.parametrize("temperature,top_k,top_p", list(itertools.product([0.5, 1.0], [0, 1, 3, 12], [1.0, 0.5, 0.9])))
    def test_matches_brute_force(self, temperature, top_k, top_p):
        logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(2))
        probs = logits_to_probs(logits, temperature, top_k, top_p)
        expected = torch.stack([_brute_force(row, temperature, top_k, top_p) for row in logits])
        assert torch.allclose(probs, expected, atol=1e-6)

    def test_ties_are_deterministic(self):
        logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
        assert torch.equal(logits_to_probs(logits, 1.0, top_k=2) > 0, torch.tensor([[False, True, True, False, False]]))
        # mass of the top token alone is 1/3 < 0.5: the nucleus adds the next tied token, id 2
        assert torch.equal(logits_to_probs(logits, 1.0, top_p=0.5) > 0, torch.tensor([[False, True, True, False, False]]))

    def test_top_p_keeps_smallest_set_reaching_mass(self):
        probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
        out = logits_to_probs(probs.log(), 1.0, top_p=0.8)  # 0.5 + 0.3 reaches 0.8
        assert torch.allclose(out, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
        out = logits_to_probs(probs.log(), 1.0, top_p=0.81)
        assert (out > 0).sum() == 3

    def test_per_row_params_equal_scalar_params(self):
        logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(3))
        temps, ks, ps = [0.0, 0.5, 1.0, 1.5, 1.0, 2.0], [0, 3, 0, 5, 1, 20], [1.0, 0.9, 0.5, 1.0, 0.3, 0.95]
        batched = logits_to_probs(logits, torch.tensor(temps), torch.tensor(ks), torch.tensor(ps))
        for i in range(6):
            single = logits_to_probs(logits[i : i + 1], temps[i], ks[i], ps[i])  # python scalars
            assert torch.equal(batched[i : i + 1], single)

    @pytest.mark.parametrize(
        "kwargs",
        [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=torch.ones(3))],
    )
    def test_bad_params(self, kwargs):
        with pytest.raises(ValueError):
            logits_to_probs(torch.zeros(2, 4), **kwargs)

    def test_bad_logits_shape(self):
        with pytest.raises(ValueError, match="logits"):
            logits_to_probs(torch.zeros(4))


class TestCounterRandomness:
    def test_uniform_open_interval_and_roughly_uniform(self):
        seeds = torch.arange(200_000) % 7
        u = uniform(seeds, torch.arange(200_000), salt=3)
        assert u.dtype == torch.float64
        assert (u > 0).all() and (u < 1).all()
        assert abs(u.mean().item() - 0.5) < 0.005
        hist = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
        assert (hist - 0.1).abs().max() < 0.005

    def test_uniform_is_pure_and_batch_independent(self):
        seeds = torch.tensor([5, -3, 2**40 + 1, 0])
        offs = torch.tensor([0, 17, 3, 2**33])
        full = uniform(seeds, offs)
        for i in range(4):
            assert torch.equal(uniform(seeds[i : i + 1], offs[i : i + 1]), full[i : i + 1])
        assert torch.equal(uniform(seeds.flip(0), offs.flip(0)), full.flip(0))

    def test_host_and_tensor_hashing_agree(self):
        # a few keys on a CPU are hashed with python ints, more with tensor ops: same numbers
        seeds = torch.tensor([5, -3, 2**40 + 1, 0, 7] * 8)
        offs = torch.arange(40) * 2**29
        full = uniform(seeds, offs, salt=9)  # 40 keys: tensor path
        for i in range(0, 40, 5):
            assert torch.equal(uniform(seeds[i : i + 5], offs[i : i + 5], salt=9), full[i : i + 5])
        noise = exponential(seeds[:20], offs[:20], 64, salt=2)  # 20 keys: tensor path
        assert torch.equal(exponential(seeds[3:5], offs[3:5], 64, salt=2), noise[3:5])

    def test_uniform_keys_change_values(self):
        base = uniform(torch.tensor([1]), torch.tensor([1]))
        for other in (
            uniform(torch.tensor([2]), torch.tensor([1])),
            uniform(torch.tensor([1]), torch.tensor([2])),
            uniform(torch.tensor([1]), torch.tensor([1]), salt=1),
            uniform(torch.tensor([1 + 2**32]), torch.tensor([1])),  # high seed bits count
        ):
            assert not torch.equal(base, other)

    def test_uniform_broadcasts(self):
        seeds, offs = torch.tensor([[3], [4]]), torch.arange(5)[None, :]
        grid = uniform(seeds, offs)
        assert grid.shape == (2, 5)
        assert torch.equal(grid[1], uniform(torch.full((5,), 4), torch.arange(5)))

    def test_successive_uniforms_uncorrelated(self):
        u = uniform(torch.zeros(100_001, dtype=torch.long), torch.arange(100_001))
        corr = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
        assert abs(corr.item()) < 0.02

    def test_exponential(self):
        seeds, offs = torch.arange(64), torch.arange(64) * 3
        e = exponential(seeds, offs, 1000, salt=9)
        assert e.shape == (64, 1000) and e.dtype == torch.float32
        assert (e > 0).all() and torch.isfinite(e).all()
        assert abs(e.mean().item() - 1) < 0.02 and abs(e.var().item() - 1) < 0.05
        assert torch.equal(exponential(seeds[5:6], offs[5:6], 1000, salt=9), e[5:6])
        assert not torch.equal(e, exponential(seeds, offs, 1000, salt=10))
        # keyed by token id: a smaller vocabulary is a prefix of a larger one
        assert torch.equal(exponential(seeds, offs, 10, salt=9), e[:, :10])

    def test_exponential_race_samples_the_distribution(self):
        probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]]) * 7  # unnormalised weights are fine
        n = 40_000
        noise = exponential(torch.zeros(n, dtype=torch.long), torch.arange(n), 4)
        draws = sample_from_probs(probs.expand(n, 4), noise)
        freq = torch.bincount(draws, minlength=4).double() / n
        assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), atol=0.01)

    def test_zero_probability_never_sampled(self):
        probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(5000, 4)
        noise = exponential(torch.ones(5000, dtype=torch.long), torch.arange(5000), 4)
        assert set(sample_from_probs(probs, noise).tolist()) == {1, 3}


    def test_inverse_cdf_samples_the_distribution(self):
        """Chi-square over 200,000 counter-based draws from a peaked distribution with zeros;
        the same test rejects a biased variant (u² instead of u)."""
        from dspec_cli.testing import gof_test

        g = torch.Generator().manual_seed(3)
        probs = torch.softmax(torch.randn(50, generator=g) * 2, -1)
        probs[::7] = 0  # masked tokens (top-k / top-p)
        n = 200_000
        u = uniform(torch.zeros(n, dtype=torch.long), torch.arange(n), salt=5)
        rows = (probs * 3).expand(n, 50)  # unnormalised weights are fine
        draws = sample_inverse_cdf(rows, u)
        assert set(draws.tolist()).isdisjoint(range(0, 50, 7))
        expected = probs / probs.sum()
        assert gof_test(draws, expected).p_value > 1e-4
        assert gof_test(sample_inverse_cdf(rows, u**2), expected).p_value < 1e-12

    def test_inverse_cdf_edges(self):
        probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
        tiny, big = torch.full((2,), 1e-300, dtype=torch.float64), torch.full((2,), 1 - 2**-52, dtype=torch.float64)
        assert sample_inverse_cdf(probs, tiny).tolist() == [2, 0]
        assert sample_inverse_cdf(probs, big).tolist() == [2, 1]


class TestTorchRandomness:
    def test_seeded_and_in_range(self):
        a = torch_uniform((1000,), generator=torch.Generator().manual_seed(0))
        b = torch_uniform((1000,), generator=torch.Generator().manual_seed(0))
        assert torch.equal(a, b) and a.dtype == torch.float64
        assert (a > 0).all() and (a < 1).all()
        e = torch_exponential((10, 50), generator=torch.Generator().manual_seed(1))
        assert e.dtype == torch.float32 and (e > 0).all() and torch.isfinite(e).all()

    def test_unseeded_on_device(self):
        assert torch_uniform((3,), device="cpu").device.type == "cpu"


# -- draws without replacement (sampled draft trees) ---------------------------------------------


def _sequential_joint(w: torch.Tensor, n: int) -> dict:
    """Exact P(x_1, ..., x_n) of successive draws without replacement from weights w [V]."""
    out = {}
    for seq in itertools.permutations(range(w.numel()), n):
        p, left = 1.0, float(w.sum())
        for x in seq:
            p *= float(w[x]) / left
            left -= float(w[x])
        out[seq] = p
    return out


def _draws_gof(draw, w: torch.Tensor, n: int, samples: int = 200_000) -> float:
    from dspec_cli.testing import chi_square_gof

    gen = torch.Generator().manual_seed(3)
    u = torch_uniform((samples, n), generator=gen)
    x = draw(w.expand(samples, -1), u)
    joint = _sequential_joint(w, n)
    keys = list(joint)
    index = {k: i for i, k in enumerate(keys)}
    counts = torch.zeros(len(keys) + 1)
    for row in x.tolist():
        counts[index.get(tuple(row), len(keys))] += 1  # last bin: duplicates (probability 0)
    return chi_square_gof(counts.numpy(), [joint[k] for k in keys] + [0.0])[2]


@pytest.mark.parametrize("weights", [[0.05, 0.5, 0.0, 0.2, 0.15, 0.1], [3.0, 1e-3, 2.0, 0.5, 0.0, 0.25]])
def test_sample_without_replacement_matches_sequential_draws(weights):
    """The joint of 3 draws (one cumulative sum, removed weight added back) is that of successive
    draws each from the remaining weights; zero-weight tokens and repeats never occur, and a draw
    that ignores the removed tokens (plain inverse CDF per draw) fails the same test."""
    from dspec_cli.core.sampling import sample_without_replacement

    w = torch.tensor(weights, dtype=torch.float64)
    assert _draws_gof(sample_without_replacement, w, 3) > 1e-4

    def ignores_removed(weights, u):  # biased: the remaining total, but removed tokens still in the CDF
        cdf = weights.cumsum(-1)
        left = cdf[:, -1].clone()
        out = []
        for j in range(u.shape[1]):
            x = torch.searchsorted(cdf, (u[:, j] * left)[:, None]).squeeze(1).clamp(max=weights.shape[1] - 1)
            out.append(x)
            left = left - weights.gather(1, x[:, None]).squeeze(1)
        return torch.stack(out, 1)

    assert _draws_gof(ignores_removed, w, 3) < 1e-12


def test_sample_without_replacement_equals_repeated_inverse_cdf():
    """The same tokens as drawing by inverse CDF from the weights with earlier draws zeroed (the
    direct way: one cumulative sum per draw), up to float64 rounding at a CDF boundary."""
    from dspec_cli.core.sampling import sample_without_replacement

    gen = torch.Generator().manual_seed(0)
    w = torch.rand(64, 300, generator=gen) ** 4
    u = torch_uniform((64, 12), generator=gen)
    direct, left = [], w.clone()
    for j in range(12):
        x = sample_inverse_cdf(left, u[:, j])
        left.scatter_(1, x[:, None], 0.0)
        direct.append(x)
    assert torch.equal(sample_without_replacement(w, u), torch.stack(direct, 1))
