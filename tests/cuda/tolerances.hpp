// dflash.cpp — tolerance table of the CUDA-vs-CPU op tests (relative Frobenius error
// ‖gpu − cpu‖ / ‖cpu‖, computed in double by dflash::test::rel_error). The CPU reference always runs
// in fp32 on the SAME inputs (bf16 inputs are rounded first and widened exactly), so the table only
// covers what the GPU path adds: summation order, fast transcendental differences, and the final
// rounding of bf16 outputs (2^-9 relative per element, ≈ 1.6e-3 Frobenius for random data).
#pragma once

namespace dflash::test::tol {

/// fp32 in, fp32 out, elementwise or per-row reductions (RMSNorm, RoPE, SwiGLU, residual).
constexpr double kF32 = 1e-5;
/// bf16 outputs of elementwise ops (one rounding of an fp32 result).
constexpr double kBf16 = 5e-3;
/// cuBLASLt GEMM, bf16 inputs, fp32 accumulation and fp32 output (only summation order differs).
constexpr double kGemmF32 = 1e-4;
/// cuBLASLt GEMM with bf16 output.
constexpr double kGemmBf16 = 5e-3;
/// Attention, bf16 q/k/v/o and bf16 gradients (fp32 statistics); forward o and all gradients.
constexpr double kAttnBf16 = 1e-2;
/// lse of attention and cross-entropy (fp32 statistics from fp32 or bf16-rounded inputs).
constexpr double kLse = 1e-5;
/// Fused LM-head CE: d_hidden goes through a bf16 dlogits GEMM.
constexpr double kCeGrad = 1e-2;
/// Fused LM-head CE loss sum (fp32 per row, double sums).
constexpr double kCeLoss = 1e-5;
/// Whole target forwards (TargetCuda taps vs the fp32 CPU target or HF's fp32 goldens on the same
/// bf16 weights): every layer's bf16 GEMM inputs, attention and (MoE) expert rounding accumulate
/// in the residual stream over the layers.
constexpr double kTargetTaps = 2e-2;
/// Deterministic double reductions that differ from the CPU only in summation order.
constexpr double kF64Sum = 1e-12;

}  // namespace dflash::test::tol
