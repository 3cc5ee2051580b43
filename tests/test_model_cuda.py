"""The whole model through the codelets' CUDA bodies, without StarPU: the reference engine's
GPU mode (ReferenceEngine(gpu=True): each codelet's CUDA body on copies of its buffers, on
GPU 0 of a CUDA build, in the CPU build's emulation of CUDA and cuBLAS, csrc/cuda/emulate.h)
against the PyTorch oracle, with test_model.py's comparisons and bounds (tests/bounds.py):
the small model's forward/backward (logits, loss, every gradient) and 10 AdamW steps (the
losses, the final parameters), matmuls in fp32 (test_model.py's fp32 bounds) and in TF32
(bounds.py, "TF32 matmuls": each matmul along a chain adds 2^14 + 4 to its length; the
emulation rounds the GEMMs' inputs to nearest TF32, as the bound assumes).

What it adds to test_kernels.py's kernel by kernel checks: the GPU kernels as the task flow
chains them (buffer order, accumulate and zeroing conventions, the lm head tied to wte, the
gradient norm feeding AdamW), so that what the GPU machine runs through StarPU
(tests/test_gpu.py) has been run end to end here first."""
from dataclasses import replace

import pytest

from bounds import D12_TF32_LOGITS, TF32_MATMUL, gpt2_chain_lengths, logits_bound
from kernel_impls import gpu_available
from starpu_llm.model.config import MODELS, ParamLayout
from test_model import compare, make_case, report, run_engine, run_torch


@pytest.fixture(scope="module", params=["fp32", "tf32", "flash", "flash-tf32"])
def cuda_bodies(request):
    """(case, errors against torch, bounds) of the small model through the CUDA bodies
    (flash: the fused attention, matmuls in fp32; flash-tf32: in TF32, its products on
    tensor cores; their chain lengths in bounds.py)."""
    why = gpu_available()
    if why:
        pytest.skip(why)
    case = replace(make_case("small"), tf32=request.param.endswith("tf32"),
                   attention="flash" if request.param.startswith("flash") else "gemm")
    out = {}
    run_torch(case, out)
    bounds = out["bounds"]
    fb, train = run_engine("cuda-bodies", case, None)
    errors = compare(ParamLayout(case.config), fb, train, (out["logits"], out["loss"], out["grads"]),
                     (out["losses"], out["params"]), bounds.params)
    report(f"small] [cuda-bodies {request.param}", errors, case, bounds)
    return case, errors, bounds


def test_cuda_bodies_match_torch(cuda_bodies):
    case, errors, bounds = cuda_bodies
    ratios = errors.ratios(case, bounds)
    # each <= 1: logits, loss and gradients of the first batch, the 10 steps' losses, the
    # final parameters, within their bounds (test_model.py says which)
    assert all(r <= 1.0 for r in ratios.values()), \
        f"{case.name} ({'tf32' if case.tf32 else 'fp32'}): error / bound {ratios}"


def test_d12_tf32_logits_bound():
    """The bound test_gpu.py holds d12's TF32 logits to (B = 1, T = 64, against the fp32
    oracle: bounds.py, "TF32 matmuls", 2^14 + 4 chain steps a GEMM, one run in TF32): the
    stated 9.1 % of max |logits| (it was 35 %), below a tenth."""
    case = make_case("d12")
    assert (case.B, case.T) == (1, 64)
    b = logits_bound(MODELS["d12"], case.B, case.T, 1.0, tf32=True)
    assert b <= D12_TF32_LOGITS < 0.1, b
    assert b > 0.99 * D12_TF32_LOGITS, f"the stated bound {D12_TF32_LOGITS} is not {b}"


def test_tf32_chains_count_the_attentions_products_where_tensor_cores_run_them():
    """With the fused attention (a GPU run's default, test_gpu.py's d12 TF32 run) at GPT-2's
    head size (64) the scores, att @ v and their backward products are TF32 MMAs, as many
    along each chain as the batched-GEMM attention's GEMMs (d12's logits bound 9.1 % either
    way). At a head size its tensor-core kernels do not take (12) they are fp32 FMAs: the TF32
    part is 2 products a block shorter along the logits and 4 along the gradients."""
    def tf32_part(cfg, attention):
        on, off = (gpt2_chain_lengths(cfg, 1, 64, tf32, attention) for tf32 in (True, False))
        return {k: on[k] - off[k] for k in on}

    d12, odd = MODELS["d12"], replace(MODELS["d12"], num_heads=64)    # hs 64, then 12
    assert tf32_part(d12, "gemm") == tf32_part(d12, "flash")
    assert logits_bound(d12, 1, 64, 1.0, tf32=True, attention="flash") <= D12_TF32_LOGITS
    gemm, flash = tf32_part(odd, "gemm"), tf32_part(odd, "flash")
    assert gemm["logits"] - flash["logits"] == 2 * odd.L * TF32_MATMUL
    assert gemm["grads"] - flash["grads"] == 4 * odd.L * TF32_MATMUL
