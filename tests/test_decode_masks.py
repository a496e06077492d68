"""A decode token's attention masks (model.py `_window_mask`, `_visible_rows`,
`_window_and_rows_mask` with one token) are spans of columns, made on the device on a GPU
and kept by span; they must equal the chunk formula's row for that token."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ds4lab.model import model

CASES = [(p0, n_kept, n_swa, n_rows, ratio)
         for p0, n_kept, n_swa, n_rows, ratio in itertools.product(
             [0, 3, 127, 128, 129, 4095], [0, 1, 5, 127, 128], [4, 128], [0, 1, 7, 31], [4, 128])
         if n_kept <= p0]


@pytest.fixture(params=["host", "device"])
def made_on(request, monkeypatch):
    """Both ways a span is made: from host bytes (the CPU) and by MLX operations (a GPU)."""
    monkeypatch.setattr(model, "batch_invariant_device", lambda: request.param == "host")
    for cached in (model._window_mask, model._visible_rows, model._window_and_rows_mask, model._span_mask):
        cached.cache_clear()
    yield request.param
    for cached in (model._window_mask, model._visible_rows, model._window_and_rows_mask, model._span_mask):
        cached.cache_clear()


def test_a_decode_tokens_masks_are_the_chunk_formulas_row(made_on):
    for p0, n_kept, n_swa, n_rows, ratio in CASES:
        # Oracle: the first token of a two-token chunk at p0, less the second token's column.
        window = np.array(model._window_mask(p0, 2, n_kept, n_swa))[0, :n_kept + 1]
        rows, counts = model._visible_rows(p0, 2, n_rows, ratio)
        rows, count = np.array(rows)[0], counts[0]
        got_window = np.array(model._window_mask(p0, 1, n_kept, n_swa))
        got_rows, got_count = model._visible_rows(p0, 1, n_rows, ratio)
        got_both = np.array(model._window_and_rows_mask(p0, 1, n_kept, n_swa, n_rows, ratio))
        case = (made_on, p0, n_kept, n_swa, n_rows, ratio)
        assert got_window.shape == (1, n_kept + 1) and np.array_equal(got_window[0], window), case
        assert np.array_equal(np.array(got_rows)[0], rows) and list(got_count) == [count], case
        assert np.array_equal(got_both[0], np.concatenate([window, rows])), case
        assert got_both.dtype == np.bool_, case


def test_with_n_swa_rows_kept_the_oldest_is_out_of_a_decode_tokens_window(made_on):
    mask = np.array(model._window_mask(200, 1, 128, 128))[0]
    assert not mask[0] and mask[1:].all()
