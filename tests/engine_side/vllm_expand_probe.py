"""Runs in the engine environment: does vLLM's CPU build expand per-request sampling parameters to
per-token ones (``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens``, which the rejection
sampler divides the target's logits by at T > 0)? Prints ``ok`` or ``defect: <what it returned>``.

vLLM 0.32.0's CPU fallback (``vllm/utils/cpu_triton_utils.py``, ``_expand_kernel_impl``) hands the
C++ kernel an int64 *copy* of the float output buffer and never copies it back, so the expanded
temperatures are whatever the fresh buffer held."""

import torch
from vllm.platforms import current_platform

if __name__ == "__main__":
    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()  # the C++ fallbacks vLLM's CPU worker registers
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    want = torch.tensor([0.7, 0.7, 0.7, 1.0, 1.0, 1.0, 1.0])
    got = expand_batch_to_tokens(torch.tensor([0.7, 1.0]), torch.tensor([3, 7], dtype=torch.int32), 7,
                                 replace_from=0, replace_to=1)
    print("ok" if torch.equal(got, want) else f"defect: {got.tolist()} for {want.tolist()}")
