"""Ragged rows <-> padded grids: the one helper set every layer uses.

A batch of R requests with n_r entries each is kept either flat ([Σn_r, ...], rows
concatenated) or as a right-padded grid ([R, W, ...]).
"""

from __future__ import annotations

import torch


def ragged(grid: torch.Tensor, counts: torch.Tensor, count_list: list[int]) -> torch.Tensor:
    """The first counts[r] entries of each row of grid [R, W, ...], rows concatenated: [Σcounts, ...].

    counts [R] long, count_list its host copy (when every row is full this is a reshape).
    """
    if min(count_list, default=0) == grid.shape[1]:
        return grid.reshape(-1, *grid.shape[2:])
    return grid[prefix_mask(counts, grid.shape[1])]


def prefix_mask(counts: torch.Tensor, width: int) -> torch.Tensor:
    """[R, width] bool: column j < counts[r]."""
    return torch.arange(width, device=counts.device)[None, :] < counts[:, None]


def to_grid(values: torch.Tensor, counts: torch.Tensor, width: int, fill: float = 0) -> torch.Tensor:
    """Flat ragged values [Σcounts, ...] -> the grid [R, width, ...], rows right-padded with ``fill``
    (counts [R] long, each <= width; no host read)."""
    R, total, tail = counts.shape[0], values.shape[0], values.shape[1:]
    if total == R * width:  # every row full
        return values.reshape(R, width, *tail)
    rows = torch.repeat_interleave(torch.arange(R, device=counts.device), counts, output_size=total)
    index = rows * width + torch.arange(total, device=counts.device) - prefix_sums(counts)[rows]
    return values.new_full((R * width, *tail), fill).index_copy(0, index, values).view(R, width, *tail)


def prefix_sums(num: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums [R+1] of lengths num [R] (on the same device)."""
    return torch.cat([num.new_zeros(1), num.cumsum(0)])
