"""Offline head-stability science (paper §2.2-2.3): record, RCO/TS, classification, figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexicache_hf.stability import (
    SelectionRecord,
    classify_unstable,
    cross_task_overlap,
    num_unstable,
    rco,
    rco_by_offset,
    rco_matrix,
    temporal_stability,
    window_starts,
)


def _record(selections, num_pages, k):
    """selections[step][layer] -> [H, <=k] pages; num_pages[step] -> N_t."""
    L, H = len(selections[0]), len(selections[0][0])
    rec = SelectionRecord(L, H, k, chunk_steps=2)
    for step, (per_layer, n) in enumerate(zip(selections, num_pages)):
        for layer, pages in enumerate(per_layer):
            rec.append(step, layer, np.asarray(pages), n)
    return rec


def _random_record(rng, L, H, k, D, n0, growth=4, pad_prob=0.2):
    rec = SelectionRecord(L, H, k, chunk_steps=7)
    for step in range(D):
        n = n0 + step // growth
        for layer in range(L):
            pages = np.full((H, k), -1)
            for h in range(H):
                size = min(k, n) if rng.random() > pad_prob else rng.integers(0, min(k, n) + 1)
                pages[h, :size] = rng.choice(n, size, replace=False)
            rec.append(step, layer, pages, n)
    return rec


# ------------------------------------------------------------------ RCO
class TestRCO:
    def test_full_overlap_is_one(self):
        assert rco([0, 1, 2, 3], [3, 2, 1, 0], k=4, n_t=16) == 1.0

    def test_chance_level_overlap_is_zero(self):
        # K/N = 4/16: one shared page out of 4 is exactly what chance predicts.
        assert rco([0, 1, 2, 3], [0, 7, 8, 9], k=4, n_t=16) == pytest.approx(0.0)

    def test_below_chance_is_clamped_to_zero(self):
        # (0/4 - 1/4) / (3/4) = -1/3 -> clamped.
        assert rco([0, 1, 2, 3], [4, 5, 6, 7], k=4, n_t=16) == 0.0

    def test_partial_overlap_value(self):
        assert rco([0, 1, 2, 3], [0, 1, 8, 9], k=4, n_t=16) == pytest.approx((0.5 - 0.25) / 0.75)

    def test_growing_n_t_changes_value(self):
        a, b = [0, 1, 2, 3], [0, 1, 8, 9]  # |∩| = 2, K = 4
        assert rco(a, b, 4, 8) == pytest.approx(0.0)  # chance already 1/2
        assert rco(a, b, 4, 16) == pytest.approx(1 / 3)
        assert rco(a, b, 4, 40) == pytest.approx((0.5 - 0.1) / 0.9)

    def test_padding_is_ignored_but_k_stays_the_budget(self):
        padded = rco([0, 1, -1, -1], [1, 0, -1, -1], k=4, n_t=16)
        assert padded == pytest.approx((2 / 4 - 0.25) / 0.75)
        assert rco(torch.tensor([0, 1, -1, -1]), np.array([1, 0, -1, -1]), 4, 16) == padded

    def test_k_at_least_n_t_falls_back_to_plain_overlap(self):
        assert rco([0, 1, 2], [2, 1, 0, -1], k=4, n_t=3) == 1.0  # everything selected twice
        assert rco([0, 1, 2, 3], [0, 1, 2, 3], k=4, n_t=4) == 1.0  # K == N_t, equal sets
        assert rco([0, 1, 2], [0, 1, 2, 3], k=4, n_t=4) == pytest.approx(3 / 4)  # a page was added
        assert rco([], [], k=4, n_t=2) == 1.0
        assert rco([0, 1, 2, 3], [0, 1, 2, 3], k=8, n_t=4) <= 1.0  # raw formula would be > 1

    def test_invalid_inputs(self):
        with pytest.raises(ValueError):
            rco([0, 1, 2], [0], k=2, n_t=10)
        with pytest.raises(ValueError):
            rco([0], [0], k=0, n_t=10)
        with pytest.raises(ValueError):
            rco([-2], [0], k=2, n_t=10)

    @settings(max_examples=200, deadline=None)
    @given(data=st.data(), n=st.integers(1, 48), k=st.integers(1, 16))
    def test_property_bounded_and_symmetric_for_fixed_n(self, data, n, k):
        subset = st.lists(st.integers(0, n - 1), unique=True, max_size=min(k, n))
        a, b = data.draw(subset), data.draw(subset)
        a_padded = a + [-1] * (k - len(a))
        r_ab, r_ba = rco(a_padded, b, k, n), rco(b, a_padded, k, n)
        assert 0.0 <= r_ab <= 1.0
        assert r_ab == r_ba


# ------------------------------------------------------------ TS by hand
# One layer, two heads, K = 2.  Head 0 never changes; head 1 drifts.
_HAND_SEL = [
    [[[0, 1], [0, 1]]],
    [[[0, 1], [1, 2]]],
    [[[0, 1], [2, 3]]],
    [[[0, 1], [0, 3]]],
]
_HAND_N = [4, 4, 5, 8]


class TestTemporalStability:
    def test_hand_computed_record(self):
        rec = _record(_HAND_SEL, _HAND_N, k=2)
        ts = temporal_stability(rec, w=3)
        assert ts.shape == (2, 1, 2)  # starts s = 0, 1
        # head 1: RCO(0,1)=(1/2-2/4)/(1/2)=0, RCO(0,2)=clamp<0=0 -> TS(0)=0
        #         RCO(1,2)=(1/2-2/5)/(3/5)=1/6, RCO(1,3)=0       -> TS(1)=1/12
        np.testing.assert_allclose(ts[:, 0, 0], [1.0, 1.0])
        np.testing.assert_allclose(ts[:, 0, 1], [0.0, 1 / 12])

    def test_stride_selects_non_overlapping_windows(self):
        rec = _record(_HAND_SEL, _HAND_N, k=2)
        np.testing.assert_array_equal(window_starts(10, 3, stride=3), [0, 3, 6])
        np.testing.assert_allclose(temporal_stability(rec, w=3, stride=2)[:, 0, 1], [0.0])

    def test_k_at_least_n_steps_score_every_head_alike(self):
        # N_t <= K: every head selects all pages, so all heads get the same TS.
        rec = _record([[[[0, -1], [0, -1]]], [[[0, 1], [1, 0]]], [[[1, 0], [0, 1]]]], [1, 2, 2], k=2)
        ts = temporal_stability(rec, w=2)
        np.testing.assert_allclose(ts[:, 0, 0], ts[:, 0, 1])
        np.testing.assert_allclose(ts[:, 0, 0], [0.5, 1.0])

    def test_too_short_record_has_no_windows(self):
        rec = _record(_HAND_SEL, _HAND_N, k=2)
        assert temporal_stability(rec, w=5).shape == (0, 1, 2)
        assert np.isnan(rco_by_offset(rec, w=5)).all()
        with pytest.raises(ValueError):
            temporal_stability(rec, w=1)

    def test_vectorised_matches_scalar_rco(self):
        rng = np.random.default_rng(0)
        rec = _random_record(rng, L=2, H=3, k=5, D=23, n0=3)  # starts with K >= N_t
        w = 6
        mat = rco_matrix(rec, w)
        starts = window_starts(rec.num_steps, w)
        for layer in range(2):
            pages, npages = rec.layer_pages(layer), rec.layer_num_pages(layer)
            for i, s in enumerate(starts):
                for d in range(1, w):
                    for h in range(3):
                        expected = rco(pages[s, h], pages[s + d, h], rec.k, int(npages[s + d]))
                        assert mat[i, d - 1, layer, h] == pytest.approx(expected)
        np.testing.assert_allclose(temporal_stability(rec, w), mat.mean(1))

    def test_rco_by_offset_hand_values_and_consistency_with_ts(self):
        rec = _record(_HAND_SEL, _HAND_N, k=2)
        np.testing.assert_allclose(rco_by_offset(rec, w=3)[:, 0, 1], [1 / 12, 0.0])
        rng = np.random.default_rng(1)
        recs = [_random_record(rng, 3, 2, 4, D, 6) for D in (17, 30)]
        by_off = rco_by_offset(recs, w=5)
        assert by_off.shape == (4, 3, 2)
        pooled_ts = np.concatenate([temporal_stability(r, w=5) for r in recs])
        np.testing.assert_allclose(by_off.mean(0), pooled_ts.mean(0))
        np.testing.assert_allclose(rco_by_offset(recs[0], 5), rco_matrix(recs[0], 5).mean(0))


# --------------------------------------------------------- classification
class TestClassification:
    def test_num_unstable_rounds_half_up(self):
        assert num_unstable(256, 0.25) == 64
        assert num_unstable(90, 0.25) == 23
        assert num_unstable(6, 0.25) == 2
        assert num_unstable(10, 0.25) == 3

    def test_most_frequent_bottom_head_is_unstable(self):
        ts = np.array([[[0.9, 0.8], [0.1, 0.7]], [[0.9, 0.2], [0.3, 0.7]], [[0.9, 0.8], [0.05, 0.7]]])
        res = classify_unstable([ts], fraction=0.25)  # m = 1 of 4 heads
        assert res.unstable == {(1, 0)}
        np.testing.assert_array_equal(res.counts, [[0, 1], [2, 0]])
        np.testing.assert_allclose(res.mean_ts, ts.mean(0))

    def test_counts_pool_windows_across_samples(self):
        a = np.array([[[0.1, 0.9, 0.9, 0.9]]])
        b = np.array([[[0.9, 0.1, 0.9, 0.9]], [[0.9, 0.1, 0.9, 0.9]]])
        res = classify_unstable([a, b], fraction=0.25)
        assert res.unstable == {(0, 1)}
        np.testing.assert_array_equal(res.counts, [[1, 2, 0, 0]])

    def test_equal_counts_break_by_lower_mean_ts_then_index(self):
        # Heads 0 and 1 are each bottom once; head 1 has the lower mean TS.
        ts = np.array([[[0.4, 0.5, 0.9, 0.9]], [[0.6, 0.1, 0.9, 0.9]]])
        assert classify_unstable([ts], 0.25).unstable == {(0, 1)}
        # Identical counts and means: lower (layer, head) wins.
        ts = np.array([[[0.9, 0.2], [0.3, 0.9]], [[0.9, 0.3], [0.2, 0.9]]])
        assert classify_unstable([ts], 0.25).unstable == {(0, 1)}

    def test_boundary_ties_count_every_tied_head(self):
        flat = np.full((1, 2, 2), 0.5)
        res = classify_unstable([flat], 0.25)
        np.testing.assert_array_equal(res.counts, [[1, 1], [1, 1]])
        assert res.unstable == {(0, 0)}

    def test_deterministic_and_order_independent(self):
        rng = np.random.default_rng(3)
        samples = [rng.random((n, 4, 3)).round(1) for n in (5, 8, 2)]
        first = classify_unstable(samples)
        again = classify_unstable(list(reversed(samples)))
        assert first.unstable == again.unstable and len(first.unstable) == 3
        np.testing.assert_array_equal(first.counts, again.counts)

    def test_fraction_zero_and_invalid_inputs(self):
        assert classify_unstable([np.zeros((2, 2, 2))], fraction=0.0).unstable == frozenset()
        with pytest.raises(ValueError):
            classify_unstable([np.zeros((0, 2, 2))])
        with pytest.raises(ValueError):
            classify_unstable([np.zeros((1, 2, 2)), np.zeros((1, 2, 3))])
        with pytest.raises(ValueError):
            classify_unstable([np.full((1, 2, 2), np.nan)])
        with pytest.raises(ValueError):
            classify_unstable([np.zeros((1, 2, 2))], fraction=1.5)


class TestCrossTaskOverlap:
    def test_matrix_properties_and_values(self):
        sets = {"a": {(0, 0), (0, 1), (1, 0), (1, 1)}, "b": {(0, 0), (0, 1), (2, 0), (2, 1)}, "c": {(0, 0), (3, 0), (3, 1), (1, 1)}}
        names, mat = cross_task_overlap(sets)
        assert names == ["a", "b", "c"]
        np.testing.assert_allclose(np.diag(mat), 1.0)
        np.testing.assert_allclose(mat, mat.T)
        assert mat[0, 1] == 0.5 and mat[1, 2] == 0.25 and mat[0, 2] == 0.5

    def test_size_mismatch_and_empty_sets_raise(self):
        with pytest.raises(ValueError):
            cross_task_overlap({"a": {(0, 0)}, "b": {(0, 0), (0, 1)}})
        with pytest.raises(ValueError):
            cross_task_overlap({"a": set(), "b": set()})


# ------------------------------------------------------------ the record
class TestSelectionRecord:
    def test_round_trip_including_partial_step(self, tmp_path):
        rng = np.random.default_rng(5)
        rec = _random_record(rng, L=3, H=2, k=4, D=9, n0=2)
        rec.append(9, 0, torch.tensor([[1, 0], [2, -1]]), 11)  # narrower + torch, layer 0 only
        path = rec.save(tmp_path / "sample")
        assert path.suffix == ".npz" and path.exists()
        back = SelectionRecord.load(path)
        assert (back.num_layers, back.num_kv_heads, back.k, back.first_step) == (3, 2, 4, 0)
        assert back.num_steps == rec.num_steps == 9
        for layer in range(3):
            np.testing.assert_array_equal(back.layer_pages(layer), rec.layer_pages(layer))
            np.testing.assert_array_equal(back.layer_num_pages(layer), rec.layer_num_pages(layer))
        back.append(9, 1, np.array([[0, 1, 2, 3], [3, 2, 1, 0]]), 11)  # continues where it stopped
        back.append(9, 2, np.array([[0], [1]]), 11)
        assert back.num_steps == 10
        np.testing.assert_array_equal(back.layer_pages(0)[9], [[1, 0, -1, -1], [2, -1, -1, -1]])

    def test_memory_is_o_d_l_h_k_independent_of_pages(self):
        L, H, k, chunk = 4, 3, 8, 16
        sizes = {}
        for D in (64, 128):
            rec = SelectionRecord(L, H, k, chunk_steps=chunk)
            for step in range(D):
                for layer in range(L):
                    # Huge N_t: a dense page mask would be D·L·H·N bytes.
                    rec.append(step, layer, np.arange(k)[None].repeat(H, 0) * 1000, 10**6)
            sizes[D] = rec.nbytes
            assert rec.nbytes <= (D + chunk) * L * (H * k + 1) * 4
        assert sizes[128] <= 2 * sizes[64] + chunk * L * (H * k + 1) * 4
        assert rec.layer_pages(0).dtype == np.int32

    def test_append_validation(self):
        rec = SelectionRecord(2, 2, 3)
        rec.append(5, 0, np.array([[0, 1, 2], [2, -1, -1]]), 3)  # any first step number
        with pytest.raises(ValueError):
            rec.append(7, 0, np.array([[0, 1, 2], [0, 1, 2]]), 3)  # skipped step
        with pytest.raises(ValueError):
            rec.append(5, 1, np.array([[0, 0, 1], [0, 1, 2]]), 3)  # duplicate page
        with pytest.raises(ValueError):
            rec.append(5, 1, np.array([[0, 1, 3], [0, 1, 2]]), 3)  # page >= N_t
        with pytest.raises(ValueError):
            rec.append(5, 1, np.zeros((3, 3), int), 3)  # wrong head count
        with pytest.raises(IndexError):
            rec.append(5, 2, np.zeros((2, 1), int), 3)
        assert rec.num_steps == 0 and rec.first_step == 5


# --------------------------------------------------------------- figures
def test_figures_write_png_without_touching_rcparams(tmp_path):
    import matplotlib

    from flexicache_hf.stability import plot_overlap_heatmap, plot_rco_vs_offset, plot_ts_distribution

    before = dict(matplotlib.rcParams)
    rng = np.random.default_rng(7)
    rec = _random_record(rng, L=2, H=3, k=4, D=20, n0=12, pad_prob=0.0)
    res = classify_unstable([temporal_stability(rec, w=4)])
    names, mat = cross_task_overlap({"t1": res.unstable, "t2": res.unstable})
    paths = [
        plot_rco_vs_offset(rco_by_offset(rec, w=4), layer=1, path=tmp_path / "fig1.png"),
        plot_ts_distribution(res.mean_ts, res.unstable, tmp_path / "ts.png"),
        plot_overlap_heatmap(names, mat, tmp_path / "sub" / "overlap.png"),
    ]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert dict(matplotlib.rcParams) == before
    assert not math.isnan(float(res.mean_ts.mean()))
