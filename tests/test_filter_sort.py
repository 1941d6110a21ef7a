"""Top-p / top-k (`sampling._filtered`): on CPU the rows are sorted by NumPy; the distribution is the one torch's
sort gives, row by row, whatever else shares the batch, and a row that filters nothing keeps every token."""

from __future__ import annotations

import torch

from dspark.sampling import _filtered, _sorted


def reference(scaled: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """The filter of one row [V] by torch's sort, written out."""
    values, order = scaled.sort(descending=True)
    keep = torch.ones_like(values, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    p = values.masked_fill(~keep, float("-inf")).softmax(-1)
    if top_p < 1.0:
        keep &= ((p.cumsum(-1) - p) < top_p) | (torch.arange(len(p)) == 0)
    out = torch.zeros_like(scaled)
    out[order[keep]] = values[keep].softmax(-1)
    return out


def test_the_filter_sorted_by_numpy_gives_what_torch_sort_gives():
    gen = torch.Generator().manual_seed(5)
    scaled = torch.cat([torch.randn(4, 2048, generator=gen) * 4.0, torch.randn(4, 2048, generator=gen) * 0.3])
    settings = [(1.0, 0), (0.5, 0), (0.9, 40), (0.99, 0)] * 2
    top_p = torch.tensor([p for p, _ in settings])
    top_k = torch.tensor([k for _, k in settings])
    together = _filtered(scaled, top_p, top_k)
    for r, (p, k) in enumerate(settings):
        expected = reference(scaled[r], p, k)
        assert torch.equal(together[r] > 0, expected > 0), r  # the same tokens kept
        assert torch.allclose(together[r], expected, atol=1e-7, rtol=1e-5), r
        assert torch.equal(_filtered(scaled[r : r + 1], top_p[r : r + 1], top_k[r : r + 1])[0], together[r]), r
    assert int((together[0] > 0).sum()) == int((together[4] > 0).sum()) == scaled.shape[-1]  # filters nothing
    assert 1 < int((together[1] > 0).sum()) < int((together[5] > 0).sum())  # a peaked row's nucleus, a flat row's


def test_rows_are_sorted_in_descending_order_with_their_positions():
    scaled = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    values, order = _sorted(scaled)
    assert torch.equal(values, scaled.sort(dim=-1, descending=True).values)
    assert torch.equal(scaled.gather(-1, order), values) and order.dtype == torch.long
