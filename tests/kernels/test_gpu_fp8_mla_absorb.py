"""GPU: MLA's absorbed products on an FP8 kv_b_proj at DeepSeek-V3.2's shapes (128 heads at TP=1,
16 at TP=8; nope 128, v 128, kv_lora 512) against their twins, and PDL on vs off identical over
CUDA-graph replays. Run on the H200 with `pytest -m gpu tests/kernels`."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import quantize_fp8_reference
from kernels.fp8_mla_absorb import (
    absorb_out_reference,
    absorb_out_triton,
    absorb_q_reference,
    absorb_q_triton,
)
from tests.kernels.conftest import assert_close, pdl_on_and_off_over_graph_replays

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
NOPE, V, KV_LORA = 128, 128, 512


def _case(num_rows: int, heads: int, pow2: bool):
    w = torch.randn(heads * (NOPE + V), KV_LORA, device=CUDA) * KV_LORA**-0.5
    weight, scale = quantize_fp8_reference(w, pow2)
    q = torch.randn(num_rows, heads, NOPE + 64, device=CUDA, dtype=torch.bfloat16)
    o_latent = torch.randn(num_rows, heads, KV_LORA, device=CUDA, dtype=torch.bfloat16)
    return q[..., :NOPE], o_latent, weight, scale


@pytest.mark.parametrize("pow2", [False, True], ids=["amax", "ue8m0"])
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("num_rows", [1, 4, 32, 128, 2048])
def test_gpu_absorbed_products_at_real_shapes(num_rows, heads, pow2) -> None:
    q_nope, o_latent, weight, scale = _case(num_rows, heads, pow2)
    assert_close(
        absorb_q_triton(q_nope, weight, scale, V, pow2),
        absorb_q_reference(q_nope, weight, scale, V),
    )
    assert_close(
        absorb_out_triton(o_latent, weight, scale, NOPE, pow2),
        absorb_out_reference(o_latent, weight, scale, NOPE),
    )


@pytest.mark.parametrize("num_rows", [1, 32])
def test_gpu_absorbed_products_pdl_on_and_off_over_graph_replays(num_rows, monkeypatch) -> None:
    q_nope, o_latent, weight, scale = _case(num_rows, 128, True)

    def make_step():
        return lambda: (
            absorb_q_triton(q_nope, weight, scale, V, True),
            absorb_out_triton(o_latent, weight, scale, NOPE, True),
        )

    on, off, mismatches = pdl_on_and_off_over_graph_replays(make_step, monkeypatch, 200)
    assert mismatches == 0
    for a, b in zip(on, off):
        assert torch.equal(a, b)
