"""torch's attention over the KV cache where the engine's kernel (cpu_kernels.py) is unavailable:
ragged rows by runs of a slot's consecutive positions, and draft-tree rows one at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openalice_runner.engine.tree import TreeMask


def runs_of(row_slot: list[int], row_pos: list[int]) -> list[tuple[int, int, int, int]]:
    """(first row, end row, slot, first position) of each slot's consecutive rows."""
    runs = []
    first = 0
    for r in range(1, len(row_slot) + 1):
        if r == len(row_slot) or row_slot[r] != row_slot[first] or row_pos[r] != row_pos[r - 1] + 1:
            runs.append((first, r, row_slot[first], row_pos[first]))
            first = r
    return runs


def attention_by_runs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, runs) -> torch.Tensor:
    """torch's SDPA, one call per run of a slot's rows (where the engine's kernel is unavailable)."""
    out = torch.empty_like(q)
    for first, end, slot, start in runs:
        steps = end - first
        span = start + steps
        mask = None
        if steps > 1:  # query t (position start + t) sees keys 0..start + t
            mask = torch.arange(span).view(1, -1) <= (start + torch.arange(steps)).view(-1, 1)
        attn = F.scaled_dot_product_attention(
            q[first:end].transpose(0, 1).unsqueeze(0),
            keys[slot : slot + 1, :, :span],
            values[slot : slot + 1, :, :span],
            attn_mask=mask,
            enable_gqa=True,
        )
        out[first:end] = attn[0].transpose(0, 1)
    return out


def attention_visible(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_slot: list[int],
                      row_pos: list[int], tree: TreeMask) -> torch.Tensor:
    """torch's SDPA one row at a time over the keys `tree` leaves visible (draft trees where the
    engine's kernel is unavailable)."""
    out = torch.empty_like(q)
    for r, (slot, pos) in enumerate(zip(row_slot, row_pos, strict=True)):
        seen = torch.tensor(tree.visible(r, pos))
        out[r] = F.scaled_dot_product_attention(
            q[r].unsqueeze(1).unsqueeze(0), keys[slot : slot + 1, :, seen], values[slot : slot + 1, :, seen],
            enable_gqa=True,
        )[0, :, 0]
    return out
