// Tests of src/core: dtype conversions, tensors and views, errors, the progress bar on a
// non-terminal, the parallel_for pool.
#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/parallel.hpp"
#include "core/philox.hpp"
#include "core/tensor.hpp"

using namespace dflash;

namespace {
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

TEST(Bf16, RoundToNearestEven) {
  // 1.0 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even -> 1.0.
  EXPECT_EQ(f32_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1.0078125 + 2^-8 is halfway between 0x3f81 and 0x3f82: ties to even -> 0x3f82.
  EXPECT_EQ(f32_to_bf16_bits(1.0078125f + std::ldexp(1.0f, -8)), 0x3f82);
  // Just above halfway rounds up.
  EXPECT_EQ(f32_to_bf16_bits(from_bits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(f32_to_bf16_bits(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  // The largest finite f32 rounds to +Inf in bf16.
  EXPECT_EQ(f32_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);
  uint16_t nan = f32_to_bf16_bits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(nan)));
  // A signalling NaN whose payload lives only in the low bits must stay NaN, not become Inf.
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(from_bits(0x7f800001u)))));
}

TEST(Bf16, ExhaustiveRoundTripOfBf16Values) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    float f = bf16_bits_to_f32(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16_bits(f), b) << "bits " << b;
  }
}

TEST(F16, ConversionsMatchKnownValues) {
  EXPECT_EQ(f32_to_f16_bits(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16_bits(65520.0f), 0x7c00);             // rounds to Inf
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000);  // tie -> even (0)
  EXPECT_EQ(f32_to_f16_bits(-0.0f), 0x8000);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = f16_bits_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16_bits(f), h) << "bits " << h;
  }
}

// Philox4x32-10 against the known-answer vectors of the Random123 reference implementation
// (kat_vectors: counter, key, output), and the uniform built from it.
TEST(Philox, MatchesTheReferenceKnownAnswers) {
  struct Kat {
    Philox4 ctr;
    uint32_t k0, k1;
    Philox4 out;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}}},
      {{{~0u, ~0u, ~0u, ~0u}}, ~0u, ~0u, {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
       0xa4093822u,
       0x299f31d0u,
       {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}},
  };
  for (const Kat& k : kats) {
    const Philox4 r = philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r.w[i], k.out.w[i]) << "word " << i;
  }
  // philox_uniform: counter (step, slot, purpose, 0), key = the seed's halves; 53 bits in [0, 1).
  const uint64_t seed = 0x299f31d0a4093822ull;
  const Philox4 r = philox4x32_10(Philox4{{7, 3, 1, 0}}, 0xa4093822u, 0x299f31d0u);
  const double want =
      static_cast<double>(((static_cast<uint64_t>(r.w[0]) << 32) | r.w[1]) >> 11) * 0x1.0p-53;
  EXPECT_EQ(philox_uniform(seed, 7, 3, PhiloxPurpose::accept), want);
  double lo = 1, hi = 0;
  for (uint32_t s = 0; s < 1000; ++s) {
    const double u = philox_uniform(seed, s, 0, PhiloxPurpose::token);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  EXPECT_GE(lo, 0.0);
  EXPECT_LT(hi, 1.0);
  EXPECT_LT(lo, 0.01);  // spread over [0, 1)
  EXPECT_GT(hi, 0.99);
}

TEST(Tensor, ShapesViewsAndSlices) {
  Tensor t = Tensor::zeros({3, 4}, DType::f32);
  for (int i = 0; i < 12; ++i) t.set_f64(i, i);
  EXPECT_TRUE(t.is_contiguous());
  Tensor col = t.slice(1, 1, 3);  // [3, 2], strided
  EXPECT_FALSE(col.is_contiguous());
  EXPECT_EQ(col.shape(), (Shape{3, 2}));
  EXPECT_EQ(col.item_f64(0), 1.0);
  EXPECT_EQ(col.item_f64(3), 6.0);
  Tensor c = col.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.to_f32_vector(), (std::vector<float>{1, 2, 5, 6, 9, 10}));
  Tensor row = t.select(0, 2);
  EXPECT_EQ(row.shape(), (Shape{4}));
  EXPECT_EQ(row.item_f64(3), 11.0);
  Tensor v = t.view({2, -1});
  EXPECT_EQ(v.shape(), (Shape{2, 6}));
  EXPECT_EQ(v.storage(), t.storage());  // a view shares storage
  EXPECT_THROW(t.view({5, -1}), Error);
  EXPECT_THROW(col.view({6}), Error);
  EXPECT_THROW(t.slice(0, 2, 4), Error);
}

TEST(Tensor, DtypeConversionAndCopy) {
  Tensor t = Tensor::from_f32({1.0f, -2.5f, 3.14159f}, {3});
  Tensor b = t.to(DType::bf16);
  EXPECT_EQ(b.dtype(), DType::bf16);
  EXPECT_EQ(b.nbytes(), 6u);
  EXPECT_FLOAT_EQ(static_cast<float>(b.item_f64(2)), round_to_bf16(3.14159f));
  Tensor z = Tensor::zeros({3}, DType::f32);
  z.copy_from(b);
  EXPECT_FLOAT_EQ(static_cast<float>(z.item_f64(1)), -2.5f);
  EXPECT_THROW(z.copy_from(Tensor::zeros({4}, DType::f32)), Error);
}

TEST(Tensor, NonOwningViewOfExternalMemory) {
  std::vector<int32_t> host = {5, 6, 7, 8};
  Tensor t = Tensor::from_blob(host.data(), {2, 2}, DType::i32);
  EXPECT_FALSE(t.storage()->owning());
  EXPECT_EQ(t.item_f64(3), 8.0);
  t.set_f64(0, 42);
  EXPECT_EQ(host[0], 42);
}

TEST(Tensor, NarrowingIntegerConversionIsChecked) {
  Tensor t = Tensor::zeros({2}, DType::i64);
  t.data<int64_t>()[1] = int64_t{1} << 40;
  EXPECT_THROW(t.to(DType::i32), Error);
}

TEST(Device, ParseAndPrint) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu());
  EXPECT_EQ(Device::parse("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::cuda(1).str(), "cuda:1");
  EXPECT_THROW(Device::parse("gpu"), Error);
  EXPECT_THROW(Device::parse("cuda:x"), Error);
#ifndef DFLASH_HAVE_CUDA
  EXPECT_THROW(Tensor::empty({4}, DType::f32, Device::cuda(0)), Error);
#endif
}

TEST(Error, CheckCarriesMessageAndContext) {
  try {
    DFLASH_CHECK(1 + 1 == 3, "tensor {}: expected shape {}, found {}", "w", "[2]", "[3]");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "tensor w: expected shape [2], found [3]");
    EXPECT_STREQ(e.with_context("file x.safetensors").what(),
                 "file x.safetensors: tensor w: expected shape [2], found [3]");
    EXPECT_FALSE(e.internal());  // a bad input
  }
}

namespace {
// Reads back what was written to `f` (a tmpfile) and counts its lines.
int lines_written(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  int lines = 0;
  for (int c; (c = std::fgetc(f)) != EOF;) lines += c == '\n';
  return lines;
}
}  // namespace

TEST(ProgressBar, OnANonTerminalPrintsOnlyWhenWorkWasDone) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressOptions o;
    o.out = f;
    o.plain_every_s = 0;  // no time limit: only the work done bounds the lines
    ProgressBar bar("stalled", 10, "steps", o);
    for (int i = 0; i < 1000; ++i) bar.advance(0);  // a stall: no line
    EXPECT_EQ(lines_written(f), 0);
    for (int i = 0; i < 3; ++i) bar.advance(1);
    EXPECT_EQ(lines_written(f), 3);
    for (int i = 0; i < 1000; ++i) bar.advance(0);
    EXPECT_EQ(lines_written(f), 3);
  }  // the final line
  EXPECT_EQ(lines_written(f), 4);
  std::fclose(f);
}

TEST(ProgressBar, WithoutPlainLinesPrintsOnlyTheFinalLineToANonTerminal) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressOptions o;
    o.out = f;
    o.plain_every_s = 0;
    o.plain_lines = false;
    ProgressBar bar("train", 10, "steps", o);
    for (int i = 0; i < 10; ++i) bar.advance(1);
    EXPECT_EQ(lines_written(f), 0);
  }
  EXPECT_EQ(lines_written(f), 1);
  std::fclose(f);
}

TEST(Error, AssertFailuresAreInternalThroughContext) {
  try {
    const int rows = 3;
    DFLASH_ASSERT(rows == 4);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_TRUE(e.internal());  // a bug: the fuzz harnesses count it as a finding
    EXPECT_NE(std::string(e.what()).find("assertion 'rows == 4' failed"), std::string::npos);
    EXPECT_TRUE(e.with_context("reading x").internal());
  }
}

// ------------------------------------------------------------------------------------ parallel_for

namespace {
// Restores the default thread count when a test ends, failed or not.
struct ThreadsGuard {
  explicit ThreadsGuard(int n) { set_parallel_threads(n); }
  ~ThreadsGuard() { set_parallel_threads(0); }
};
long kernel_tid() {
  return static_cast<long>(::syscall(SYS_gettid));
}
}  // namespace

TEST(ParallelFor, EveryIndexOnceInContiguousChunksForAnyThreadCount) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadsGuard g(threads);
    for (int64_t n : {1, 2, 7, 64, 1000}) {
      for (int64_t min_chunk : {1, 3, 100}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::mutex mu;
        std::vector<std::pair<int64_t, int64_t>> chunks;
        parallel_for(
            n,
            [&](int64_t b, int64_t e) {
              for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
              std::lock_guard lock(mu);
              chunks.emplace_back(b, e);
            },
            min_chunk);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << i;
        const int64_t workers = std::min<int64_t>(threads, (n + min_chunk - 1) / min_chunk);
        EXPECT_EQ(static_cast<int64_t>(chunks.size()), workers) << n << " " << min_chunk;
        for (const auto& [b, e] : chunks) EXPECT_GE(e - b, n / workers);
      }
    }
  }
}

// Chunks run on threads that outlive the call: over many calls, the chunks run on at most
// parallel_threads() distinct kernel threads (a pool that started threads per call would show
// fresh ids every call). Chunks sleep a little so that pool threads wake up and claim some.
TEST(ParallelFor, ReusesItsThreadsAcrossCalls) {
  ThreadsGuard g(3);
  std::mutex mu;
  std::set<long> ids;
  for (int call = 0; call < 20; ++call) {
    parallel_for(3, [&](int64_t, int64_t) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::lock_guard lock(mu);
      ids.insert(kernel_tid());
    });
  }
  EXPECT_LE(ids.size(), 3u);
  EXPECT_GE(ids.size(), 2u) << "no pool thread ever ran a chunk";
  EXPECT_TRUE(ids.count(kernel_tid()));  // the caller runs chunks too
}

TEST(ParallelFor, RethrowsTheFirstChunksErrorAfterAllChunksRan) {
  ThreadsGuard g(4);
  std::atomic<int> ran{0};
  try {
    parallel_for(4, [&](int64_t b, int64_t) {
      ++ran;
      if (b >= 1) fail("chunk {} failed", b);
    });
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "chunk 1 failed");
  }
  EXPECT_EQ(ran, 4);
  // The pool still works after an error.
  std::atomic<int64_t> sum{0};
  parallel_for(100, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) sum += i;
  });
  EXPECT_EQ(sum, 4950);
}

// A parallel_for inside a chunk, and calls from several threads at once, run their chunks
// (inline when the pool is busy) and give the same result.
TEST(ParallelFor, NestedAndConcurrentCallsComplete) {
  ThreadsGuard g(2);
  auto nested_sum = [] {
    std::atomic<int64_t> sum{0};
    parallel_for(8, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        parallel_for(10, [&](int64_t b2, int64_t e2) {
          for (int64_t j = b2; j < e2; ++j) sum += i * 10 + j;
        });
      }
    });
    return sum.load();
  };
  EXPECT_EQ(nested_sum(), 79 * 80 / 2);
  std::vector<int64_t> results(4, -1);
  std::vector<std::thread> callers;
  for (size_t c = 0; c < results.size(); ++c) {
    callers.emplace_back([&, c] {
      int64_t total = 0;
      for (int rep = 0; rep < 50; ++rep) total += nested_sum();
      results[c] = total;
    });
  }
  for (auto& t : callers) t.join();
  for (int64_t r : results) EXPECT_EQ(r, 50 * (79 * 80 / 2));
}
