"""Test-suite settings: tiny models run fastest single-threaded (no oversubscription)."""

import torch

torch.set_num_threads(1)
