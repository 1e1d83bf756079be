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


def to_grid(values: torch.Tensor, rows: int, q: int, flat: torch.Tensor | None, fill: int = 0) -> torch.Tensor:
    """Flat ragged values [Σn] -> grid [R, q] right-padded with ``fill`` (flat [Σn]: their index
    into [R*q]; None: every row is full)."""
    if flat is None:
        return values.view(rows, q)
    return values.new_full((rows * q,), fill).index_copy(0, flat, values).view(rows, q)


def flatten(grid: torch.Tensor, flat: torch.Tensor | None) -> torch.Tensor:
    """grid [R, q, ...] -> the flat ragged entries [Σn, ...] at flat [Σn] (None: all of them;
    the inverse of :func:`to_grid`)."""
    rows_q = grid.reshape(grid.shape[0] * grid.shape[1], *grid.shape[2:])
    return rows_q if flat is None else rows_q.index_select(0, flat)


def prefix_sums(num: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums [R+1] of lengths num [R] (on the same device)."""
    return torch.cat([num.new_zeros(1), num.cumsum(0)])
