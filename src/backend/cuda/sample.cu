// dflash.cpp — kernels of the sampling ops (contracts and formulas in src/ops/sample.hpp, launchers
// declared in backend/cuda/sample_launch.hpp). One CTA of kThreads threads works on one logits row
// (processing, a draft) or one request (acceptance); every sum runs in a fixed order or on
// integers, so a row gives the same bits on every run (a seed reproduces a generation).
#include <cmath>

#include "backend/cuda/common.cuh"
#include "backend/cuda/sample_launch.hpp"
#include "core/philox.hpp"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kBins = 256;                        // radix digits of 8 bits
constexpr double kFixedOne = 4503599627370496.0;  // 2^52: the unit of the top-p masses

// The bits of x as an unsigned key of the same order (−0 and +0 are one key, as they compare
// equal).
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t u = x == 0.0f ? 0u : __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

struct RowShared {
  unsigned int count[kBins];
  unsigned long long mass[kBins];
  double red[32];
  float redf[32];
  uint32_t prefix, remaining, ties;
  unsigned long long above;
  int owner, pick;
};

__device__ __forceinline__ float block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  return warp_max(lane < nw ? sh[lane] : -INFINITY);
}

// The exclusive prefix sum of v over the threads in thread order (fixed order), and the total.
__device__ double block_exclusive_scan(double v, double* sh, double& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  double s = v;
  for (int o = 1; o < 32; o <<= 1) {
    const double t = __shfl_up_sync(0xffffffffu, s, o);
    if (lane >= o) s += t;
  }
  double excl = __shfl_up_sync(0xffffffffu, s, 1);
  if (lane == 0) excl = 0.0;
  __syncthreads();
  if (lane == 31) sh[warp] = s;
  __syncthreads();
  if (warp == 0) {
    double w = lane < nw ? sh[lane] : 0.0;
    for (int o = 1; o < 32; o <<= 1) {
      const double t = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += t;
    }
    if (lane < nw) sh[lane] = w;  // inclusive sums of the warps' totals
  }
  __syncthreads();
  total = sh[nw - 1];
  const double r = (warp > 0 ? sh[warp - 1] : 0.0) + excl;
  __syncthreads();
  return r;
}

// This thread's contiguous slice [lo, hi) of a row of V entries (the draws and the top-p tie cut
// walk the row in id order).
__device__ __forceinline__ void thread_slice(int64_t V, int64_t& lo, int64_t& hi) {
  const int64_t chunk = (V + blockDim.x - 1) / blockDim.x;
  lo = min(V, static_cast<int64_t>(threadIdx.x) * chunk);
  hi = min(V, lo + chunk);
}

// The inverse-CDF draw of ops/sample.hpp from the weights w(i), i < V, with the uniform u: the
// smallest i whose inclusive prefix sum exceeds u · Σ w, never a weight ≤ 0; −1 when Σ w is not
// positive. Every thread of the block calls it and gets the token.
template <typename W>
__device__ int32_t block_draw(const W& w, int64_t V, double u, RowShared& sh) {
  int64_t lo, hi;
  thread_slice(V, lo, hi);
  double s = 0;
  for (int64_t i = lo; i < hi; ++i) {
    const double wi = w(i);
    if (wi > 0) s += wi;
  }
  double total;
  const double before = block_exclusive_scan(s, sh.red, total);
  if (!(total > 0)) return -1;
  const double target = u * total;
  if (threadIdx.x == 0) sh.owner = -1;
  __syncthreads();
  // The owner: the last slice with mass that starts at or below the target (the first slice with
  // mass starts at exactly 0, so there is one).
  if (s > 0 && before <= target) atomicMax(&sh.owner, static_cast<int>(threadIdx.x));
  __syncthreads();
  if (static_cast<int>(threadIdx.x) == sh.owner) {
    double acc = before;
    int64_t last = -1, pick = -1;
    for (int64_t i = lo; i < hi && pick < 0; ++i) {
      const double wi = w(i);
      if (!(wi > 0)) continue;
      acc += wi;
      last = i;
      if (target < acc) pick = i;
    }
    sh.pick = static_cast<int>(pick >= 0 ? pick : last);  // past the end by rounding: its last
  }
  __syncthreads();
  const int32_t t = sh.pick;
  __syncthreads();
  return t;
}

// The key of the k-th largest of x_i = row[i] · inv_t (radix select, 8 bits a pass).
__device__ uint32_t kth_largest_key(const float* row, int64_t V, float inv_t, uint32_t k,
                                    RowShared& sh) {
  uint32_t prefix = 0, mask = 0, remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kBins; i += blockDim.x) sh.count[i] = 0;
    __syncthreads();
    // Warp-aggregated counts: every lane of a warp runs the same iterations (a block-uniform
    // loop), lanes of one bin add once through their first lane.
    for (int64_t base = 0; base < V; base += blockDim.x) {
      const int64_t i = base + threadIdx.x;
      const uint32_t key = i < V ? order_key(row[i] * inv_t) : 0u;
      const bool in = i < V && (key & mask) == prefix;
      const uint32_t bin = in ? (key >> shift) & 0xffu : 0xffffffffu;
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (in && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&sh.count[bin], __popc(peers));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t above = 0;
      int bin = kBins - 1;
      for (; bin > 0; --bin) {
        if (above + sh.count[bin] >= remaining) break;
        above += sh.count[bin];
      }
      sh.prefix = prefix | (static_cast<uint32_t>(bin) << shift);
      sh.remaining = remaining - above;
    }
    __syncthreads();
    prefix = sh.prefix;
    remaining = sh.remaining;
    mask |= 0xffu << shift;
  }
  return prefix;
}

// Fixed-point mass (units of 2^-52) of a token of scaled logit x.
__device__ __forceinline__ unsigned long long fixed_mass(float x, float mx, double z) {
  return static_cast<unsigned long long>(static_cast<double>(expf(x - mx)) / z * kFixedOne + 0.5);
}

// Top-p over the tokens of key ≥ kth: the key v* of the last kept value (ops/sample.hpp), the
// fixed-point mass `above` of the tokens of larger keys, and the count of tokens of key v*.
__device__ void top_p_cut(const float* row, int64_t V, float inv_t, float mx, double z,
                          uint32_t kth, double top_p, RowShared& sh, uint32_t& vkey,
                          unsigned long long& above, uint32_t& ties) {
  const auto P = static_cast<unsigned long long>(top_p * kFixedOne);
  uint32_t prefix = 0, mask = 0;
  above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
      sh.count[i] = 0;
      sh.mass[i] = 0;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      const float x = row[i] * inv_t;
      const uint32_t key = order_key(x);
      if (key < kth || (key & mask) != prefix) continue;
      const uint32_t bin = (key >> shift) & 0xffu;
      atomicAdd(&sh.count[bin], 1u);
      const unsigned long long m = fixed_mass(x, mx, z);
      if (m) atomicAdd(&sh.mass[bin], m);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      // The lowest non-empty bin whose tokens can still start before mass P is reached: bin b
      // qualifies while above + (mass of the bins above b) < P. None (P rounds to 0): the top bin.
      unsigned long long s = 0, s_chosen = 0;
      int chosen = -1, top = -1;
      for (int b = kBins - 1; b >= 0; --b) {
        if (sh.count[b] > 0 && top < 0) top = b;
        if (above + s >= P) break;
        if (sh.count[b] > 0) {
          chosen = b;
          s_chosen = s;
        }
        s += sh.mass[b];
      }
      if (chosen < 0) {
        chosen = top;
        s_chosen = 0;
      }
      sh.prefix = prefix | (static_cast<uint32_t>(chosen) << shift);
      sh.above = above + s_chosen;
      sh.ties = sh.count[chosen];
    }
    __syncthreads();
    prefix = sh.prefix;
    above = sh.above;
    ties = sh.ties;
    mask |= 0xffu << shift;
  }
  vkey = prefix;
}

// The processed distribution of one row (ops/sample.hpp).
__global__ void __launch_bounds__(kThreads)
    sample_probs_kernel(float* probs, const float* logits, int64_t V, int skip,
                        const SampleParamsDevice* params, int32_t* status, int rows_per_request) {
  const int64_t r = blockIdx.x;
  if (skip > 0 && r % skip == 0) return;
  __shared__ RowShared sh;
  const float* row = logits + r * V;
  float* out = probs + r * V;
  const float inv_t = params->inv_temperature;
  const double top_p = params->top_p;
  const int32_t top_k = params->top_k;
  // 1. The largest scaled logit; NaN anywhere makes the row bad (the CPU throws there).
  float mx = -INFINITY;
  int nan = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float l = row[i];
    if (isnan(l))
      nan = 1;
    else
      mx = fmaxf(mx, l * inv_t);
  }
  nan = __syncthreads_or(nan);
  mx = block_max(mx, sh.redf);
  if (nan || mx == -INFINITY) {
    if (threadIdx.x == 0)
      status[r / rows_per_request] = nan ? kSampleStatusNan : kSampleStatusNoFinite;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) out[i] = 0.0f;
    return;
  }
  // 2. top-k: keep the keys ≥ the k-th largest.
  const uint32_t kth = top_k > 0 && top_k < V
                           ? kth_largest_key(row, V, inv_t, static_cast<uint32_t>(top_k), sh)
                           : 0u;
  // 3. The softmax normaliser over the kept tokens.
  double z = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float x = row[i] * inv_t;
    if (order_key(x) >= kth) z += expf(x - mx);
  }
  z = block_sum(z, sh.red);
  // 4. top-p: the last kept value v*, and how many of its tokens (by id) stay.
  uint32_t vkey = 0, ties = 0, keep_ties = 0xffffffffu;
  if (top_p < 1.0) {
    unsigned long long above = 0;
    top_p_cut(row, V, inv_t, mx, z, kth, top_p, sh, vkey, above, ties);
    const auto P = static_cast<unsigned long long>(top_p * kFixedOne);
    const unsigned long long w = fixed_mass(key_value(vkey), mx, z);
    // Tie c (0-based by id) is kept iff above + c·w < P (c = 0 always: v* was chosen so).
    const unsigned long long d = P > above ? P - above : 0;
    if (d == 0) {
      keep_ties = 1;  // top_p below one fixed-point unit: the first token of the top value
    } else if (w == 0) {
      keep_ties = ties;
    } else {
      const unsigned long long n = (d - 1) / w + 1;
      keep_ties = n < ties ? static_cast<uint32_t>(n) : ties;
    }
  }
  const uint32_t lo_key = top_p < 1.0 ? vkey : kth;
  const bool cut = keep_ties < ties;
  // The rank of this slice's first v* token among all of them (needed only when ties are cut).
  int64_t lo, hi;
  thread_slice(V, lo, hi);
  double rank0 = 0;
  if (cut) {
    double mine = 0, all;
    for (int64_t i = lo; i < hi; ++i) mine += order_key(row[i] * inv_t) == vkey ? 1.0 : 0.0;
    rank0 = block_exclusive_scan(mine, sh.red, all);
  }
  auto kept = [&](uint32_t key, uint32_t& rank) {
    if (key < lo_key || key < kth) return false;
    if (key != vkey || !cut) return true;
    return rank++ < keep_ties;
  };
  // 5. The kept mass, then the row (same slices, same order: the same tokens kept).
  double zk = z;
  if (top_p < 1.0) {
    uint32_t rank = static_cast<uint32_t>(rank0);
    double s = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const float x = row[i] * inv_t;
      if (kept(order_key(x), rank)) s += expf(x - mx);
    }
    zk = block_sum(s, sh.red);
  }
  __syncthreads();
  uint32_t rank = static_cast<uint32_t>(rank0);
  for (int64_t i = lo; i < hi; ++i) {
    const float x = row[i] * inv_t;
    out[i] = kept(order_key(x), rank) ? static_cast<float>(expf(x - mx) / zk) : 0.0f;
  }
}

// One CTA per drafted slot (b, k), k in [1, K).
__global__ void __launch_bounds__(kThreads)
    sample_drafts_kernel(int32_t* block, const float* q, const uint64_t* seeds,
                         const int32_t* steps, int K, int64_t V) {
  __shared__ RowShared sh;
  const int b = blockIdx.x / (K - 1), k = blockIdx.x % (K - 1) + 1;
  const int64_t row = static_cast<int64_t>(b) * K + k;
  const float* qr = q + row * V;
  const double u = philox_uniform(seeds[b], static_cast<uint32_t>(steps[b]),
                                  static_cast<uint32_t>(k), PhiloxPurpose::draft);
  const int32_t t = block_draw([qr](int64_t i) { return static_cast<double>(qr[i]); }, V, u, sh);
  // A q row of no mass comes with a status set by sample_probs (the step reports it).
  if (threadIdx.x == 0) block[row] = t >= 0 ? t : 0;
}

// One CTA per request: the rejection rule of ops/sample.hpp.
__global__ void __launch_bounds__(kThreads)
    spec_sample_accept_kernel(int32_t* out, int32_t* lens, int32_t* block, int32_t* steps,
                              const float* p, const float* q, const uint64_t* seeds,
                              const int32_t* status, const int32_t* active, int K, int64_t V,
                              int32_t mask) {
  __shared__ RowShared sh;
  __shared__ int s_n, s_rejected;
  const int b = blockIdx.x;
  int32_t* o = out + static_cast<int64_t>(b) * (K + 1);
  if (!active[b] || status[b]) {
    if (threadIdx.x == 0) o[0] = active[b] ? -status[b] : 0;
    return;
  }
  int32_t* blk = block + static_cast<int64_t>(b) * K;
  const uint64_t seed = seeds[b];
  const auto step = static_cast<uint32_t>(steps[b]);
  const int64_t row0 = static_cast<int64_t>(b) * K;
  if (threadIdx.x == 0) {
    int n = 0, rejected = 0;
    while (n + 1 < K) {
      const int32_t d = blk[n + 1];
      const double pd = p[(row0 + n) * V + d], qd = q[(row0 + n + 1) * V + d];
      // qd > 0: d was drawn from q_{n+1}, and a draw never takes a token of weight 0.
      const double a = qd > 0 ? fmin(1.0, pd / qd) : 0.0;
      if (philox_uniform(seed, step, static_cast<uint32_t>(n + 1), PhiloxPurpose::accept) < a) {
        ++n;
      } else {
        rejected = 1;
        break;
      }
    }
    s_n = n;
    s_rejected = rejected;
  }
  __syncthreads();
  const int n = s_n;
  const float* pn = p + (row0 + n) * V;
  const double u = philox_uniform(seed, step, static_cast<uint32_t>(n + 1), PhiloxPurpose::token);
  int32_t t = -1;
  if (s_rejected) {
    const float* qn = q + (row0 + n + 1) * V;
    t = block_draw([pn, qn](int64_t i) { return fmax(0.0, static_cast<double>(pn[i]) - qn[i]); }, V,
                   u, sh);
  }
  if (t < 0)  // all accepted (the bonus), or p ≤ q everywhere (the residual is p itself)
    t = block_draw([pn](int64_t i) { return static_cast<double>(pn[i]); }, V, u, sh);
  if (threadIdx.x != 0) return;
  o[0] = n + 1;
  for (int i = 0; i < n; ++i) o[1 + i] = blk[1 + i];
  o[1 + n] = t;
  lens[b] += n + 1;
  steps[b] = static_cast<int32_t>(step + 1);
  blk[0] = t;
  for (int k = 1; k < K; ++k) blk[k] = mask;
}

__global__ void __launch_bounds__(kThreads)
    sample_first_kernel(int32_t* token, const float* p, uint64_t* seeds, int32_t* steps,
                        const int32_t* status, int b, uint64_t seed, int64_t V) {
  __shared__ RowShared sh;
  if (status[b]) {
    if (threadIdx.x == 0) *token = -status[b];
    return;
  }
  const double u = philox_uniform(seed, 0, 0, PhiloxPurpose::token);
  const int32_t t = block_draw([p](int64_t i) { return static_cast<double>(p[i]); }, V, u, sh);
  if (threadIdx.x != 0) return;
  *token = t >= 0 ? t : -kSampleStatusNoFinite;
  seeds[b] = seed;
  steps[b] = 1;
}

}  // namespace

namespace launch {

void sample_probs(float* probs, const float* logits, int64_t R, int64_t V, int skip,
                  const SampleParamsDevice* params, int32_t* status, int rows_per_request,
                  cudaStream_t s) {
  if (R == 0) return;
  sample_probs_kernel<<<static_cast<unsigned>(R), kThreads, 0, s>>>(probs, logits, V, skip, params,
                                                                    status, rows_per_request);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void sample_drafts(int32_t* block, const float* q, const uint64_t* seeds, const int32_t* steps,
                   int B, int K, int64_t V, cudaStream_t s) {
  sample_drafts_kernel<<<static_cast<unsigned>(B * (K - 1)), kThreads, 0, s>>>(block, q, seeds,
                                                                               steps, K, V);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void spec_sample_accept(int32_t* out, int32_t* lens, int32_t* block, int32_t* steps, const float* p,
                        const float* q, const uint64_t* seeds, const int32_t* status,
                        const int32_t* active, int B, int K, int64_t V, int32_t mask,
                        cudaStream_t s) {
  spec_sample_accept_kernel<<<static_cast<unsigned>(B), kThreads, 0, s>>>(
      out, lens, block, steps, p, q, seeds, status, active, K, V, mask);
  DFLASH_CUDA_LAUNCH_CHECK();
}

void sample_first(int32_t* token, const float* p, uint64_t* seeds, int32_t* steps,
                  const int32_t* status, int b, uint64_t seed, int64_t V, cudaStream_t s) {
  sample_first_kernel<<<1, kThreads, 0, s>>>(token, p, seeds, steps, status, b, seed, V);
  DFLASH_CUDA_LAUNCH_CHECK();
}

}  // namespace launch
}  // namespace dflash::cuda
