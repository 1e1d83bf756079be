"""The private APIs of dependencies that dspec relies on, each read in one place. These tests fail
loudly, naming that place, when an upgrade removes one (the code there then falls back or fails)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3

from dspec_cli.core.hub_env import bound_timeouts
from dspec_cli.nn.linear import PackedWeight, onednn_ops
from dspec_cli.runtime.attention import attn_implementation


def test_transformers_attn_implementation():
    """transformers' ``config._attn_implementation`` (dspec_cli/runtime/attention.py)."""
    model = tiny_qwen3()
    assert attn_implementation(model) == model.config._attn_implementation
    model.set_attn_implementation("eager")
    assert attn_implementation(model) == "eager", "update attn_implementation in dspec_cli/runtime/attention.py"


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch build has no oneDNN")
def test_onednn_linear_ops():
    """``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise`` (dspec_cli/nn/linear.py)."""
    assert onednn_ops() is not None, "PyTorch's oneDNN linear ops moved: update onednn_ops in dspec_cli/nn/linear.py"
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((5, 16), (8, 16), (8,)))
    with torch.no_grad():
        torch.testing.assert_close(PackedWeight().linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_hub_default_client_factory():
    """``huggingface_hub.utils._http.default_client_factory`` (dspec_cli/core/hub_env.py): without it
    Hub requests fall back to huggingface_hub's client, which waits forever."""
    from huggingface_hub import get_session
    from huggingface_hub.utils._http import default_client_factory  # noqa: F401 - the import is the test

    bound_timeouts()
    assert get_session().timeout.read is not None, "update bound_timeouts in dspec_cli/core/hub_env.py"


def test_torch_graph_runner_internals():
    """``torch.utils._pytree.tree_leaves``, ``torch.utils._python_dispatch.TorchDispatchMode``,
    ``torch._dynamo.config.recompile_limit`` and ``torch._inductor.config.freezing``
    (dspec_cli/runtime/graphs.py: check mode and compile mode, inductor's freezing on a CPU)."""
    import torch._inductor.config
    from torch.utils import _pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    assert _pytree.tree_leaves((torch.zeros(1), [torch.ones(2)]))[1].shape == (2,), "update dspec_cli/runtime/graphs.py"
    assert isinstance(TorchDispatchMode, type), "update dspec_cli/runtime/graphs.py"
    assert isinstance(torch._dynamo.config.recompile_limit, int), "update GraphRunner in dspec_cli/runtime/graphs.py"
    with torch._inductor.config.patch(freezing=True):
        assert torch._inductor.config.freezing, "update _frozen in dspec_cli/runtime/graphs.py"
