"""Statistical harness for losslessness tests (docs/verification.md), public so plugin authors
test their drafters the way dspec tests its own.

* :mod:`~dspec_cli.testing.gof`: goodness of fit (:func:`chi_square_gof`, :func:`gof_test`,
  :func:`assert_same_distribution`) of samples against exact probabilities.
* :mod:`~dspec_cli.testing.toy`: toy models with exact distributions (:class:`ToyLM`,
  :class:`ToyDrafter`, :func:`exact_target_joint`).
* :mod:`~dspec_cli.testing.simulate`: many requests through plain (:func:`sample_target`,
  :func:`greedy_target`) or speculative decoding of toy models (:func:`simulate_speculative`,
  :func:`simulate_tree_speculative`).
* :mod:`~dspec_cli.testing.policies`: length policies (the scheduler hook of the simulations)
  and the paper's Appendix A counterexample (:func:`appendix_a`).
* :mod:`~dspec_cli.testing.end_to_end`: the engine on a real target against the exact
  probabilities of its continuations (:func:`check_engine_lossless`).

Typical use::

    tokens = simulate_speculative(target, drafter, num_requests=200_000, gamma=3, num_tokens=2,
                                  x0=0, generator=torch.Generator().manual_seed(0))
    assert_same_distribution(tokens, exact_target_joint(target, 0, 2), name="first two tokens")
"""

from dspec_cli.testing.end_to_end import (
    Continuations,
    assert_continuations_match,
    check_engine_lossless,
    exact_continuations,
    results_by_concurrency,
)
from dspec_cli.testing.gof import (
    GofResult,
    assert_same_distribution,
    chi2_sf,
    chi_square_gof,
    gof_test,
    joint_index,
)
from dspec_cli.testing.policies import (
    AppendixA,
    LengthPolicy,
    appendix_a,
    fixed_length_policy,
    random_length_policy,
    throughput_length_policy,
)
from dspec_cli.testing.simulate import (
    check_chain_result,
    check_tree_result,
    greedy_target,
    random_tree,
    sample_target,
    simulate_speculative,
    simulate_tree_speculative,
)
from dspec_cli.testing.toy import (
    ToyDrafter,
    ToyLM,
    exact_target_joint,
    sample_categorical,
)

__all__ = [
    "AppendixA", "Continuations", "GofResult", "LengthPolicy", "ToyDrafter", "ToyLM", "appendix_a",
    "assert_continuations_match", "assert_same_distribution", "check_chain_result", "check_engine_lossless",
    "check_tree_result", "chi2_sf", "chi_square_gof", "exact_continuations", "exact_target_joint",
    "fixed_length_policy", "gof_test", "greedy_target", "joint_index", "random_length_policy", "random_tree",
    "results_by_concurrency", "sample_categorical", "sample_target", "simulate_speculative",
    "simulate_tree_speculative", "throughput_length_policy",
]
