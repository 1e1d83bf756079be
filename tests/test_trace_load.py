"""The trace-replay load benchmark: forced greedy acceptance follows the recorded traces."""

import json

import torch

from benchmarks import trace_load
from dspec_cli.runtime.verify import verify_greedy_grid


def test_force_greedy_accepts_exactly_the_drawn_count():
    """Padded rows of the static round (ℓ_r <= W, one padding row past R): verification accepts
    the drawn count, cut at each row's drafts."""
    g = torch.Generator().manual_seed(0)
    ell = torch.tensor([7, 0, 3, 7, 2])
    accepted = torch.tensor([3, 5, 7, 0, 2])
    ids = torch.randint(50, (6, 8), generator=g)  # [n, 1 + W]: anchor, drafts; row 5 is padding
    logits = torch.randn(6, 8, 50, generator=g)
    trace_load.force_greedy(logits, ids, accepted)
    res = verify_greedy_grid(logits[:5], ids[:5, 1:], ell)
    assert res.accepted.tolist() == torch.minimum(accepted, ell).tolist()


def test_fixed_scheduler_replays_the_traces(tmp_path):
    """Every trace round accepts 3 of 7: each fixed-γ round accepts min(3, ℓ)."""
    traces = tmp_path / "traces.jsonl"
    line = {"drafter": "dspark-markov", "block_size": 7, "confidence": [0.9, 0.8, 0.7, 0.3, 0.2, 0.2, 0.1], "accepted": 3}
    traces.write_text((json.dumps(line) + "\n") * 20)
    out = tmp_path / "load.json"
    trace_load.main(["--traces", str(traces), "--shape", "tiny", "--device", "cpu", "--concurrency", "2",
                     "--scheduler", "fixed", "--max-new-tokens", "20", "--profile-grid", "1,8,16",
                     "--profile-contexts", "64", "--json", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    assert run["trace_tau_full_verification"] == 4.0
    assert run["cond_accept"][:4] == [1.0, 1.0, 1.0, 0.0]
    assert run["generated_tokens"] == 4 * 20
