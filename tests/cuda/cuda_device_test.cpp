// CUDA smoke test: device discovery and a device tensor round trip. Skips without a GPU.
#include <gtest/gtest.h>

#include "backend/cuda/device.hpp"
#include "core/tensor.hpp"

using namespace dflash;

TEST(CudaDevice, TensorRoundTrip) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  EXPECT_FALSE(cuda::device_description(0).empty());
  Tensor h = Tensor::from_f32({1, 2, 3, 4, 5}, {5});
  Tensor d = Tensor::empty({5}, DType::f32, Device::cuda(0));
  d.copy_from(h);
  Tensor back = Tensor::zeros({5}, DType::f32);
  back.copy_from(d);
  EXPECT_EQ(back.to_f32_vector(), h.to_f32_vector());
}
