// dflash.cpp — launchers of the tensor-core attention kernels (src/backend/cuda/attention_tc.cuh:
// the work split, tiles and numerics are described there). Forward: one kernel. Backward: Δ, then
// dq per query item, then the key-tile spans and dk/dv per key tile; all on one stream. The
// argument blocks, the launch with its shared-memory opt-in and the pre-passes are shared with
// the Hopper kernels (attention_tc_launch.cuh).
#include "backend/cuda/attention_launch.hpp"
#include "backend/cuda/attention_tc_launch.cuh"

namespace dflash::cuda {
namespace {

using namespace attn_tc;

// Items per warp of the forward kernel (attention_tc.cuh: 2 halves the shared-memory reads and
// the K/V traffic per query row).
constexpr int kFwdItemsPerWarp = 2;

dim3 query_grid(const Args& a, int ipw) {
  return dim3(static_cast<unsigned>(query_ctas(a, ipw)), static_cast<unsigned>(a.NKV));
}

template <int D>
void fwd_d(const Args& a, cudaStream_t s) {
  launch_attn_kernel(attn_tc_fwd_kernel<D, kFwdItemsPerWarp>, query_grid(a, kFwdItemsPerWarp),
                     kThreads, query_cta_smem<D, kFwdItemsPerWarp>(1), a, s);
}

template <int D>
void bwd_d(const Args& a, float* delta, int* span, cudaStream_t s) {
  launch_attn_delta<D>(a, delta, s);
  if (a.dq)
    launch_attn_kernel(attn_tc_dq_kernel<D>, query_grid(a, 1), kThreads, query_cta_smem<D, 1>(2), a,
                       s);
  if ((a.dk || a.dv) && a.Tk > 0) {
    launch_attn_spans(a, span, s);
    launch_attn_kernel(attn_tc_dkdv_kernel<D>, dim3(static_cast<unsigned>(key_tiles(a) * a.NKV)),
                       kThreads, dkdv_smem<D>(), a, s);
  }
}

}  // namespace

namespace launch {

void attention_tc_fwd(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                      const uint16_t* v, const AttnRange* ranges, const AttnParams& p,
                      cudaStream_t s) {
  if (p.Tq == 0) return;
  const Args a = attn_fwd_args(o, lse, q, k, v, ranges, p);
  if (p.D == 64)
    fwd_d<64>(a, s);
  else
    fwd_d<128>(a, s);
}

void attention_tc_bwd(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                      const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                      const float* lse, const AttnRange* ranges, const AttnParams& p,
                      float* delta_ws, int* span_ws, cudaStream_t s) {
  if (attn_bwd_without_rows(dk, dv, p, s)) return;
  const Args a = attn_bwd_args(dq, dk, dv, dout, q, k, v, o, lse, ranges, p, delta_ws, span_ws);
  if (p.D == 64)
    bwd_d<64>(a, delta_ws, span_ws, s);
  else
    bwd_d<128>(a, delta_ws, span_ws, s);
}

}  // namespace launch
}  // namespace dflash::cuda
