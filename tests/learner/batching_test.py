"""Micro-batch counts, row splits and the bucketed completion trim."""

import numpy as np
import pytest

from m2po_jax.learner import batching


def test_completion_width_buckets():
    widths = [batching.completion_width(n, 256) for n in range(257)]
    assert sorted(set(widths)) == [16, 24, 32, 48, 64, 96, 128, 192, 256]
    for longest, width in enumerate(widths):
        assert width >= longest  # never drops a generated column
        assert width == 16 or width <= max(longest, 1) * 1.5  # padding stays bounded
    assert batching.completion_width(5, 8) == 8  # capped by the buffer
    with pytest.raises(ValueError, match="longest=9"):
        batching.completion_width(9, 8)


@pytest.mark.parametrize("seed", range(5))
def test_trim_keeps_every_generated_token(seed):
    rng = np.random.default_rng(seed)
    rows, prompt, new = 6, 5, 100
    lengths = rng.integers(0, 60, rows)
    valid = np.zeros((rows, prompt + new), bool)
    valid[:, 2:prompt] = True
    for r, n in enumerate(lengths):
        valid[r, prompt : prompt + n] = True
    tokens = np.where(valid, rng.integers(1, 50, valid.shape), 0)
    arrays = {"tokens_BxT": tokens, "valid_BxT": valid, "rewards_B": np.ones(rows)}
    out, width = batching.trim_completions(arrays, prompt, new)
    assert width == batching.completion_width(int(lengths.max()), new)
    assert out["tokens_BxT"].shape == (rows, prompt + width)
    assert out["valid_BxT"].sum() == valid.sum()  # nothing generated is lost
    np.testing.assert_array_equal(out["tokens_BxT"], tokens[:, : prompt + width])
    assert out["rewards_B"] is arrays["rewards_B"]


def test_trim_refuses_a_wrong_width():
    with pytest.raises(ValueError, match="expected prompt_len \\+ max_new_tokens = 5 \\+ 10"):
        batching.trim_completions({"valid_BxT": np.ones((2, 12), bool)}, 5, 10)


def test_check_prompt_groups_names_the_group_that_differs():
    tokens = np.repeat(np.arange(12).reshape(3, 4), 2, axis=0)  # 3 groups of 2 rows
    tokens = np.concatenate([tokens, np.arange(6)[:, None]], axis=1)  # completions differ
    valid = np.ones_like(tokens, bool)
    batching.check_prompt_groups(tokens, valid, 4, 2)
    bad = tokens.copy()
    bad[3, 1] += 1
    with pytest.raises(ValueError, match=r"rows 2\.\.3 .* first 4 tokens columns differ"):
        batching.check_prompt_groups(bad, valid, 4, 2)
    bad_valid = valid.copy()
    bad_valid[5, 0] = False
    with pytest.raises(ValueError, match=r"rows 4\.\.5 .* valid columns differ"):
        batching.check_prompt_groups(tokens, bad_valid, 4, 2)
    with pytest.raises(ValueError, match="group_size=4"):
        batching.check_prompt_groups(tokens, valid, 4, 4)


@pytest.mark.parametrize(
    "longest, width",
    [(15, 16), (16, 16), (17, 24), (24, 24), (25, 32), (32, 32), (33, 48), (48, 48), (49, 64)],
)
def test_trim_at_a_bucket_edge_keeps_the_last_column(longest, width):
    """A longest completion ending exactly on a bucket's last column keeps that column
    (and that bucket); one token more selects the next bucket."""
    rows, prompt, new = 3, 4, 64
    valid = np.zeros((rows, prompt + new), bool)
    valid[:, 1:prompt] = True
    valid[0, prompt : prompt + longest] = True  # the longest row
    valid[1, prompt : prompt + 3] = True
    tokens = np.where(valid, np.arange(prompt + new)[None, :] + 1, 0).astype(np.int32)
    mask = valid.copy()
    mask[:, :prompt] = False
    arrays = {"tokens_BxT": tokens, "valid_BxT": valid, "loss_mask_BxT": mask}
    out, got_width = batching.trim_completions(arrays, prompt, new)
    assert got_width == width
    end = prompt + width
    for name, x in arrays.items():
        assert out[name].shape == (rows, end), name
        np.testing.assert_array_equal(out[name], x[:, :end], err_msg=name)
    last = prompt + longest - 1  # the final generated token's column
    assert out["valid_BxT"][0, last] and out["tokens_BxT"][0, last] == last + 1
    assert out["loss_mask_BxT"].sum() == mask.sum()  # no completion token dropped
    assert not valid[:, end:].any()  # everything cut was padding


def test_micro_batches_at_and_just_above_the_token_cap():
    """Every micro-batch holds at most max_tokens_per_mb (padded) tokens, and there are no
    more of them than that needs: the fewest equal parts (a divisor of the rows, at least
    n_mbs) that fit, by brute force."""
    assert batching.micro_batch_count(8, 7, 1, 56) == 1  # exactly at the cap: one
    assert batching.micro_batch_count(8, 7, 1, 55) == 2  # one token over: two
    assert batching.micro_batch_count(8, 7, 1, 27) == 4  # 3 would fit, 3 does not divide 8
    assert batching.micro_batch_count(8, 7, 1, 7) == 8  # one row each
    with pytest.raises(ValueError, match=r"max_tokens_per_mb=6 is below one row's 7 tokens"):
        batching.micro_batch_count(8, 7, 1, 6)
    for rows in (1, 4, 6, 8, 12):
        for seq in (1, 5, 7):
            for n_mbs in (1, 2, 3):
                for cap in [0, *range(seq, rows * seq + 2)]:
                    fits = [
                        n for n in range(1, rows + 1)
                        if rows % n == 0 and n >= n_mbs and (not cap or rows // n * seq <= cap)
                    ]  # fmt: skip
                    if not fits:
                        with pytest.raises(ValueError):
                            batching.micro_batch_count(rows, seq, n_mbs, cap)
                        continue
                    got = batching.micro_batch_count(rows, seq, n_mbs, cap)
                    assert got == fits[0], (rows, seq, n_mbs, cap)
