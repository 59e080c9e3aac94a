// dflash.cpp — launchers of the tensor-core attention kernels (src/backend/cuda/attention_tc.cuh:
// the work split, tiles and numerics are described there). Forward: one kernel. Backward: Δ, then
// dq per query item, then the key-tile spans and dk/dv per key tile; all on one stream.
#include "backend/cuda/attention_launch.hpp"
#include "backend/cuda/attention_tc.cuh"

namespace dflash::cuda {
namespace {

using namespace attn_tc;

// Items per warp of the forward kernel (attention_tc.cuh: 2 halves the shared-memory reads and
// the K/V traffic per query row).
constexpr int kFwdItemsPerWarp = 2;

dim3 query_grid(const Args& a, int ipw) {
  return dim3(static_cast<unsigned>(query_ctas(a, ipw)), static_cast<unsigned>(a.NKV));
}

template <typename Kernel>
void launch_kernel(Kernel kernel, dim3 grid, int smem, const Args& a, cudaStream_t s) {
  // Raising the dynamic shared-memory limit is a per-device attribute of the function, not a
  // stream operation: cheap, and allowed while a graph is being captured.
  DFLASH_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, s>>>(a);
  DFLASH_CUDA_LAUNCH_CHECK();
}

template <int D>
void fwd_d(const Args& a, cudaStream_t s) {
  launch_kernel(attn_tc_fwd_kernel<D, kFwdItemsPerWarp>, query_grid(a, kFwdItemsPerWarp),
                query_cta_smem<D, kFwdItemsPerWarp>(1), a, s);
}

template <int D>
void bwd_d(const Args& a, float* delta, int* span, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(a.Tq) * a.NH;
  attn_tc_delta_kernel<D><<<grid_for(rows * 8, 256), 256, 0, s>>>(delta, a.dout, a.o, a.Tq, a.NH);
  DFLASH_CUDA_LAUNCH_CHECK();
  if (a.dq) launch_kernel(attn_tc_dq_kernel<D>, query_grid(a, 1), query_cta_smem<D, 1>(2), a, s);
  if ((a.dk || a.dv) && a.Tk > 0) {
    const int n_tiles = key_tiles(a);
    attn_tc_span_init_kernel<<<grid_for(n_tiles, 256), 256, 0, s>>>(span, n_tiles);
    DFLASH_CUDA_LAUNCH_CHECK();
    attn_tc_span_kernel<<<grid_for(a.Tq, 256), 256, 0, s>>>(span, a.ranges, a.Tq, a.Tk);
    DFLASH_CUDA_LAUNCH_CHECK();
    launch_kernel(attn_tc_dkdv_kernel<D>, dim3(static_cast<unsigned>(n_tiles * a.NKV)),
                  dkdv_smem<D>(), a, s);
  }
}

}  // namespace

namespace launch {

void attention_tc_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                      const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                      cudaStream_t s) {
  if (p.Tq == 0) return;
  Args a = make_args(p, ranges);
  a.q = q, a.k = k, a.v = v, a.out = o, a.lse_out = lse;
  if (p.D == 64)
    fwd_d<64>(a, s);
  else
    fwd_d<128>(a, s);
}

void attention_tc_bwd(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                      const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                      const float* lse, const AttnRange* ranges, const AttnParams& p,
                      float* delta_ws, int* span_ws, cudaStream_t s) {
  if (p.Tq == 0) {
    const size_t bytes = static_cast<size_t>(p.Tk * p.NKV * p.D) * 2;
    if (dk && bytes) DFLASH_CUDA_CHECK(cudaMemsetAsync(dk, 0, bytes, s));
    if (dv && bytes) DFLASH_CUDA_CHECK(cudaMemsetAsync(dv, 0, bytes, s));
    return;
  }
  Args a = make_args(p, ranges);
  a.q = q, a.k = k, a.v = v, a.o = o, a.dout = dout;
  a.dq = dq, a.dk = dk, a.dv = dv, a.lse = lse, a.delta = delta_ws, a.span = span_ws;
  if (p.D == 64)
    bwd_d<64>(a, delta_ws, span_ws, s);
  else
    bwd_d<128>(a, delta_ws, span_ws, s);
}

}  // namespace launch
}  // namespace dflash::cuda
