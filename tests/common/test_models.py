import time

import pytest
import torch

from common import models
from common.models import compute_dtype


def _linear_seconds(dtype: torch.dtype) -> float:
    x, w = torch.randn(256, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    torch.nn.functional.linear(x, w)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        runs.append(time.perf_counter() - start)
    return min(runs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_computes_in_float32_where_it_is_slower_on_this_cpu(dtype):
    chosen = compute_dtype(dtype, torch.device("cpu"))
    assert chosen in (dtype, torch.float32)
    half, single = _linear_seconds(dtype), _linear_seconds(torch.float32)
    # the probe's choice agrees with a second measurement wherever the two differ by more than noise
    if half < single / 2:
        assert chosen == dtype
    if half > single * 2:
        assert chosen == torch.float32
    assert compute_dtype(dtype, torch.device("cuda")) == dtype
    assert compute_dtype(torch.float32, torch.device("cpu")) == torch.float32


def test_a_slow_half_precision_is_computed_in_float32(monkeypatch):
    monkeypatch.setattr(models, "_half_is_fast", lambda dtype: False)
    assert compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    monkeypatch.setattr(models, "_half_is_fast", lambda dtype: True)
    assert compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
