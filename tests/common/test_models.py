import pytest
import torch

from common.models import compute_dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_computes_in_float32_on_a_cpu_without_its_kernels(dtype):
    fast = {
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
    }
    assert compute_dtype(dtype, torch.device("cpu")) == (dtype if fast[dtype]() else torch.float32)
    assert compute_dtype(dtype, torch.device("cuda")) == dtype
    assert compute_dtype(torch.float32, torch.device("cpu")) == torch.float32
