"""Test-only: vLLM 0.32.0's CPU ``expand`` fallback with its defect fixed, loaded into every vLLM
process (this folder on PYTHONPATH) when ``DSPEC_TEST_FIX_VLLM_EXPAND=1``.

The defect (``vllm/utils/cpu_triton_utils.py``, ``_expand_kernel_impl``): the float output buffer is
converted to an int64 copy for the C++ kernel and never written back, so at T > 0 the rejection
sampler divides the target's logits by uninitialised per-token temperatures. The replacement
computes the same expansion in torch: ``output[start_r:end_r] = input[r]`` (``replace_from`` ->
``replace_to``), with ``cu_num_tokens`` the inclusive cumulative token counts. The patch is applied
when vLLM imports the module, before its CPU platform registers the fallback."""

import importlib.abc
import importlib.machinery
import os
import sys

MODULE = "vllm.utils.cpu_triton_utils"


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(counts.sum())] = torch.repeat_interleave(values, counts).to(output.dtype)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._expand_kernel_impl = _expand_kernel_impl

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("DSPEC_TEST_FIX_VLLM_EXPAND") == "1":
    sys.meta_path.insert(0, _PatchOnImport())
