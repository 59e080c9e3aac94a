// dflash.cpp — DecodeHeadsCuda (see decoder_cuda_heads.hpp): the DSpark and Domino heads' weights,
// scratch and slot-by-slot walk on the device.
#include "infer/decoder_cuda_heads.hpp"

#ifdef DFLASH_HAVE_CUDA

#include <cuda_runtime.h>

#include <cmath>

#include "backend/cuda/arena.hpp"
#include "backend/cuda/check.hpp"
#include "backend/cuda/context.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "infer/decoder_cuda.hpp"
#include "ops/decode.hpp"
#include "ops/decode_heads.hpp"
#include "ops/fill.hpp"
#include "ops/sample.hpp"

namespace dflash {

namespace {

template <typename T>
DecodeHeadBuffer head_buffer(const std::string& name, int64_t count, T** dst) {
  return DecodeHeadBuffer{"decode.heads." + name, static_cast<uint64_t>(count) * sizeof(T),
                          reinterpret_cast<void**>(dst)};
}

}  // namespace

DecodeHeadsCuda::DecodeHeadsCuda(const DrafterConfig& cfg, int max_batch)
    : cfg_(cfg), max_batch_(max_batch) {
  DFLASH_CHECK(handles(cfg), "DecodeHeadsCuda: the drafter has neither DSpark nor Domino heads");
  DFLASH_CHECK(!(cfg.dspark.enabled && cfg.domino.enabled) && !cfg.dflash2.enabled,
               "DecodeHeadsCuda: a drafter with more than one of the DSpark, Domino and DFlash2 "
               "heads");
  DFLASH_CHECK(max_batch >= 1 && cfg.block_size >= 2,
               "DecodeHeadsCuda: bad sizes (max_batch {}, block_size {})", max_batch,
               cfg.block_size);
  DFLASH_CHECK(!cfg.dspark.enabled || cfg.dspark.markov_rank >= 0,
               "DecodeHeadsCuda: negative markov_rank {}", cfg.dspark.markov_rank);
}

std::vector<DecodeHeadBuffer> DecodeHeadsCuda::buffers() {
  const int64_t B = max_batch_, H = cfg_.hidden_size, V = cfg_.vocab_size, K = cfg_.block_size;
  std::vector<DecodeHeadBuffer> w;
  w.push_back(head_buffer("row", B * V, &row_));
  if (cfg_.dspark.enabled) {
    const int64_t r = cfg_.dspark.markov_rank;
    w.push_back(head_buffer("dspark.input", B * K, &input_));
    if (r == 0) return w;  // no Markov head: D = U
    w.push_back(head_buffer("dspark.markov_w1", V * r, &w1_));
    w.push_back(head_buffer("dspark.markov_w2", V * r, &w2_));
    if (cfg_.dspark.markov_type == MarkovHeadType::gated) {
      w.push_back(head_buffer("dspark.gate_w", r * (H + r), &gate_w_));
      w.push_back(head_buffer("dspark.gate_b", r, &gate_b_));
    }
    if (cfg_.dspark.markov_type == MarkovHeadType::rnn) {
      w.push_back(head_buffer("dspark.joint_w", 3 * r * (2 * r + H), &joint_w_));
      w.push_back(head_buffer("dspark.joint_b", 3 * r, &joint_b_));
    }
    w.push_back(head_buffer("dspark.x", B * (2 * r + H), &x_));
    w.push_back(head_buffer("dspark.u", B * 3 * r, &u_));
    w.push_back(head_buffer("dspark.z", B * r, &z_));
    w.push_back(head_buffer("dspark.state", B * r, &state_));
    return w;
  }
  const int64_t G = cfg_.domino.gru_hidden_dim, E = cfg_.domino.emb_dim;
  w.push_back(head_buffer("domino.gru_ih", 3 * G * H, &gru_ih_));
  w.push_back(head_buffer("domino.gru_hh", 3 * G * G, &gru_hh_));
  w.push_back(head_buffer("domino.proj1", E * (H + G), &proj1_));
  w.push_back(head_buffer("domino.proj2", V * E, &proj2_));
  w.push_back(head_buffer("domino.x", B * (H + G), &x_));
  w.push_back(head_buffer("domino.xi", B * 3 * G, &u_));
  w.push_back(head_buffer("domino.hh", B * 3 * G, &hh_));
  w.push_back(head_buffer("domino.a", B * E, &z_));
  w.push_back(head_buffer("domino.state", B * G, &state_));
  return w;
}

void DecodeHeadsCuda::upload(cuda::PinnedUploader& up, const LoadedDrafter& drafter) {
  const DrafterLayout& L = drafter.layout;
  const float* P = drafter.params.data();
  const int64_t H = cfg_.hidden_size, V = cfg_.vocab_size;
  auto f32 = [&](float* dst, int64_t offset, int64_t n, const char* name) {
    DFLASH_CHECK(offset >= 0 && offset + n <= static_cast<int64_t>(drafter.params.size()),
                 "drafter layout: tensor '{}' ({} values at offset {}) is not in the {} "
                 "parameters",
                 name, n, offset, drafter.params.size());
    up.upload(dst, P + offset, static_cast<size_t>(n) * sizeof(float));
  };
  if (cfg_.dspark.enabled) {
    const int64_t r = cfg_.dspark.markov_rank;
    if (r == 0) return;
    f32(w1_, L.dspark.markov_w1, V * r, "markov_head.markov_w1.weight");
    f32(w2_, L.dspark.markov_w2, V * r, "markov_head.markov_w2.weight");
    if (cfg_.dspark.markov_type == MarkovHeadType::gated) {
      f32(gate_w_, L.dspark.gate_w, r * (H + r), "markov_head.gate_proj.weight");
      f32(gate_b_, L.dspark.gate_b, r, "markov_head.gate_proj.bias");
    }
    if (cfg_.dspark.markov_type == MarkovHeadType::rnn) {
      f32(joint_w_, L.dspark.joint_w, 3 * r * (2 * r + H), "markov_head.joint_proj.weight");
      f32(joint_b_, L.dspark.joint_b, 3 * r, "markov_head.joint_proj.bias");
    }
    return;
  }
  const int64_t G = cfg_.domino.gru_hidden_dim, E = cfg_.domino.emb_dim;
  f32(gru_ih_, L.domino.gru_ih, 3 * G * H, "prefix_gru.weight_ih_l0");
  f32(gru_hh_, L.domino.gru_hh, 3 * G * G, "prefix_gru.weight_hh_l0");
  f32(proj1_, L.domino.proj1, E * (H + G), "embed_proj.0.weight");
  f32(proj2_, L.domino.proj2, V * E, "embed_proj.2.weight");
}

void DecodeHeadsCuda::randomize(cuda::CudaContext& ctx, uint64_t seed) {
  const int64_t H = cfg_.hidden_size, V = cfg_.vocab_size;
  const float bound = 0.02f * std::sqrt(3.0f);  // uniform with standard deviation 0.02
  uint64_t stream = seed;
  auto fill = [&](float* w, int64_t n) {
    if (w) fill_uniform_cuda(ctx, w, n, 0.0f, bound, ++stream);
  };
  if (cfg_.dspark.enabled) {
    const int64_t r = cfg_.dspark.markov_rank;
    fill(w1_, V * r);
    fill(w2_, V * r);
    fill(gate_w_, r * (H + r));
    fill(gate_b_, r);
    fill(joint_w_, 3 * r * (2 * r + H));
    fill(joint_b_, 3 * r);
    return;
  }
  const int64_t G = cfg_.domino.gru_hidden_dim, E = cfg_.domino.emb_dim;
  fill(gru_ih_, 3 * G * H);
  fill(gru_hh_, 3 * G * G);
  fill(proj1_, E * (H + G));
  fill(proj2_, V * E);
}

const int32_t* DecodeHeadsCuda::drafter_input(cuda::CudaContext& ctx, const int32_t* block, int B,
                                              int K, int32_t mask) {
  if (!cfg_.dspark.enabled) return block;
  dspark_decode_input_cuda(ctx, input_, block, B, K, mask);
  return input_;
}

void DecodeHeadsCuda::walk(cuda::CudaContext& ctx, int B, int K, const HeadWalkIo& io) {
  DFLASH_CHECK(B >= 1 && B <= max_batch_ && K >= 2 && K <= cfg_.block_size,
               "DecodeHeadsCuda::walk: B={} K={} for {} requests of block size {}", B, K,
               max_batch_, cfg_.block_size);
  if (cfg_.dspark.enabled)
    walk_dspark(ctx, B, K, io);
  else
    walk_domino(ctx, B, K, io);
}

void DecodeHeadsCuda::propose(cuda::CudaContext& ctx, int B, int ld_block, int col,
                              const float* row, int64_t ld, const HeadWalkIo& io) {
  const int64_t V = cfg_.vocab_size;
  if (!io.sampled) {
    decode_slot_argmax_cuda(ctx, io.block, ld_block, col, row, ld, B, V);
    return;
  }
  if (row != row_)  // a base-only slot: its rows U_k, strided by the block, into row_
    DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(row_, V * sizeof(float), row, ld * sizeof(float),
                                        V * sizeof(float), static_cast<size_t>(B),
                                        cudaMemcpyDeviceToDevice, ctx.stream()));
  sample_probs_cuda(ctx, row_, row_, B, V, 0, io.params, io.status, 1);
  decode_slot_draw_cuda(ctx, io.block, ld_block, col, io.q, row_, io.seeds, io.steps, B, V);
}

void DecodeHeadsCuda::walk_dspark(cuda::CudaContext& ctx, int B, int K, const HeadWalkIo& io) {
  const int64_t H = cfg_.hidden_size, V = cfg_.vocab_size, r = cfg_.dspark.markov_rank;
  const int Kv = K + 1;
  const MarkovHeadType type = cfg_.dspark.markov_type;
  if (r > 0 && type == MarkovHeadType::rnn)
    DFLASH_CUDA_CHECK(
        cudaMemsetAsync(state_, 0, static_cast<size_t>(B * r) * sizeof(float), ctx.stream()));
  for (int k = 0; k < K; ++k) {
    const float* U = io.base + k * V;  // row b·K + k of request b: leading dimension K·V
    if (r == 0) {
      propose(ctx, B, Kv, k + 1, U, K * V, io);
      continue;
    }
    // h_k of request b is row b·K + k of the final-norm rows; e = W1[prev], prev = block[b·Kv + k]
    // (the anchor at k = 0, else d_{k−1}).
    const HeadSegment h{.bf16 = io.hidden, .ld = H, .n = H, .row_stride = K, .row_offset = k};
    const HeadSegment e{
        .f32 = w1_, .ld = r, .n = r, .index = io.block, .index_ld = Kv, .index_col = k};
    switch (type) {
      case MarkovHeadType::vanilla:
        head_pack_cuda(ctx, z_, B, e);
        break;
      case MarkovHeadType::gated:
        head_pack_cuda(ctx, x_, B, h, e);
        head_linear_cuda(ctx, u_, r, nullptr, 0, gate_w_, gate_b_, x_, B, H + r, r);
        dspark_decode_gated_cuda(ctx, z_, u_, x_ + H, H + r, B, r);
        break;
      case MarkovHeadType::rnn: {
        const HeadSegment s{.f32 = state_, .ld = r, .n = r, .row_stride = 1};
        head_pack_cuda(ctx, x_, B, s, e, h);
        head_linear_cuda(ctx, u_, 3 * r, nullptr, 0, joint_w_, joint_b_, x_, B, 2 * r + H, 3 * r);
        dspark_decode_rnn_cuda(ctx, z_, state_, u_, B, r);
        break;
      }
    }
    head_linear_cuda(ctx, row_, V, U, K * V, w2_, nullptr, z_, B, r, V);  // D_k = U_k + W2·z
    propose(ctx, B, Kv, k + 1, row_, V, io);
  }
}

void DecodeHeadsCuda::walk_domino(cuda::CudaContext& ctx, int B, int K, const HeadWalkIo& io) {
  const int64_t H = cfg_.hidden_size, V = cfg_.vocab_size;
  const int64_t G = cfg_.domino.gru_hidden_dim, E = cfg_.domino.emb_dim;
  const int first = cfg_.domino.shift_label ? 0 : 1, s0 = cfg_.domino.suffix_start();
  DFLASH_CUDA_CHECK(
      cudaMemsetAsync(state_, 0, static_cast<size_t>(B * G) * sizeof(float), ctx.stream()));
  for (int j = 0; j + 1 < K; ++j) {
    const int k = first + j;  // the slot of proposal j (block column j + 1)
    // Feed block[j] (the anchor, then proposal j − 1): g ← GRU(Embed(block[j]), g).
    const HeadSegment e{
        .bf16 = io.embed, .ld = H, .n = H, .index = io.block, .index_ld = K, .index_col = j};
    head_pack_cuda(ctx, x_, B, e);
    head_linear_cuda(ctx, u_, 3 * G, nullptr, 0, gru_ih_, nullptr, x_, B, H, 3 * G);
    head_linear_cuda(ctx, hh_, 3 * G, nullptr, 0, gru_hh_, nullptr, state_, B, G, 3 * G);
    domino_decode_gru_cuda(ctx, state_, u_, hh_, B, G);
    const float* U = io.base + k * V;
    if (k < s0) {  // a pure-draft prefix slot: F_k = U_k
      propose(ctx, B, K, j + 1, U, K * V, io);
      continue;
    }
    const HeadSegment h{.bf16 = io.hidden, .ld = H, .n = H, .row_stride = K, .row_offset = k};
    const HeadSegment g{.f32 = state_, .ld = G, .n = G, .row_stride = 1};
    head_pack_cuda(ctx, x_, B, h, g);
    head_linear_cuda(ctx, z_, E, nullptr, 0, proj1_, nullptr, x_, B, H + G, E);
    head_silu_cuda(ctx, z_, int64_t{B} * E);
    head_linear_cuda(ctx, row_, V, U, K * V, proj2_, nullptr, z_, B, E, V);  // F_k
    propose(ctx, B, K, j + 1, row_, V, io);
  }
}

// SpeculativeDecoderCuda's test hook for the heads (declared in infer/decoder_cuda.hpp), here
// beside the walk it exposes.
SpeculativeDecoderCuda::DraftTrace SpeculativeDecoderCuda::draft_trace(
    std::span<const int32_t> prompt, const DecodeOptions& opts) {
  check_drafter("draft_trace");
  DFLASH_CHECK(
      heads_ != nullptr,
      "draft_trace: the drafter has no DSpark or Domino head (draft_logits serves DFlash)");
  opts.sampling.validate();
  const int K = opts.block_size == 0 ? dcfg_.block_size : opts.block_size;
  const int Kv = verify_width(K);
  const auto P = static_cast<int64_t>(prompt.size());
  DFLASH_CHECK(K >= 2 && K <= dcfg_.block_size && P >= 1 && P <= limits_.max_prefill &&
                   P + Kv <= limits_.max_context,
               "draft_trace: a prompt of {} tokens, block size {} (limits: prompt {}, context {}, "
               "block {})",
               P, K, limits_.max_prefill, limits_.max_context, dcfg_.block_size);
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{sampled_};
  set_sampling(opts);
  DraftTrace t;
  t.first = prefill(0, prompt, K, true, opts.seed);
  check_sample_status(t.first, 0);
  decode_rows_cuda(ctx_, pos_, slots_, causal_, brange_, lens_, 1, K, 0, stride_);
  draft_block(1, K);
  const int64_t V = tcfg_.vocab_size, H = dcfg_.hidden_size;
  t.base_logits.resize(static_cast<size_t>(K * V));
  std::vector<uint16_t> hb(static_cast<size_t>(K * H));
  std::vector<int32_t> blk(static_cast<size_t>(Kv));
  const cudaStream_t s = ctx_.stream();
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(t.base_logits.data(), logits_,
                                    t.base_logits.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                    s));
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(hb.data(), fnorm_, hb.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(
      cudaMemcpyAsync(blk.data(), block_, blk.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  if (sampled_) {  // q rows 1..Kv−1 of request 0 (row 0 is the anchor's, unused)
    t.q.resize(static_cast<size_t>((Kv - 1) * V));
    DFLASH_CUDA_CHECK(
        cudaMemcpyAsync(t.q.data(), q_ + V, t.q.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
  }
  int32_t status = 0;
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(&status, status_, sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  ctx_.synchronize();
  check_sample_status(-status, 0);
  t.hidden.resize(hb.size());
  for (size_t i = 0; i < hb.size(); ++i) t.hidden[i] = bf16_bits_to_f32(hb[i]);
  t.proposals.assign(blk.begin() + 1, blk.end());
  return t;
}

}  // namespace dflash

#endif  // DFLASH_HAVE_CUDA
