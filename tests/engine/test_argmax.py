"""row_argmax against torch.argmax on fresh random rows: widths with and without a tail past the
last whole block, ties, NaN, +-inf, all -inf rows, fp16 / bf16."""

from __future__ import annotations

import pytest
import torch

from edgellm.argmax import BLOCK, MIN_COLUMNS, row_argmax


@pytest.mark.parametrize("cols", [MIN_COLUMNS - 1, MIN_COLUMNS, 49152, 151936, 4 * BLOCK + 77, 262144])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_equals_torch_argmax_on_random_rows(rows, cols):
    g = torch.Generator().manual_seed(rows * 7919 + cols)
    x = torch.randn(rows, cols, generator=g)
    assert torch.equal(row_argmax(x), torch.argmax(x, -1))


@pytest.mark.parametrize("cols", [4 * BLOCK + 77, 8 * BLOCK])
def test_ties_nan_and_inf_follow_torch(cols):
    g = torch.Generator().manual_seed(cols)
    # few distinct values: every row has many ties for its maximum, in the blocks and in the tail
    x = torch.randint(0, 5, (12, cols), generator=g).float()
    x[1, -1] = 9.0  # the maximum in the tail (or the last block)
    x[2, BLOCK + 3] = float("nan")
    x[3, -2] = float("nan")  # a NaN in the tail only
    x[4, 5] = float("nan")
    x[4, -3] = float("nan")  # the first NaN wins
    x[5] = float("-inf")  # nothing possible: index 0
    x[6, 7] = float("inf")
    x[6, -1] = float("inf")  # tie of +inf: the first
    x[7, :] = 2.0
    x[7, -5] = 3.0
    x[8, -5:] = 4.0  # the tail ties the blocks' maximum: the earlier index
    for r in range(9, 12):
        x[r] = torch.randperm(cols, generator=g).float()  # one maximum, anywhere
    assert torch.equal(row_argmax(x), torch.argmax(x, -1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rows(dtype):
    x = torch.randn(5, 3 * MIN_COLUMNS + 11, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert torch.equal(row_argmax(x), torch.argmax(x, -1))


def test_non_contiguous_rows():
    x = torch.randn(6, 2 * MIN_COLUMNS + 5, generator=torch.Generator().manual_seed(4))
    view = x[::2]
    assert torch.equal(row_argmax(view), torch.argmax(view, -1))
