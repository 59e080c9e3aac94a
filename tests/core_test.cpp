// Tests of src/core: dtype conversions, tensors and views, errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "core/dtype.hpp"
#include "core/error.hpp"
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
