// Shared between the per-level kernel objects and the binding.
#pragma once
#include <cstdint>

#include "adam_math.h"

namespace zerostack {

// Dtype codes, the same on the Python side (zerostack.fused_adam._kernels).
constexpr int kF32 = 0;
constexpr int kF16 = 1;
constexpr int kBF16 = 2;

// One tensor's step: pointers, dtypes and the step's scalars.
struct AdamArgs {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* out;  // nullptr when there is no copy-out
  int param_dtype;
  int grad_dtype;
  int out_dtype;  // -1 when out is nullptr
  AdamScalars s;  // adam_math.h's, the same as the CUDA kernel's
};

void adam_range_scalar(const AdamArgs& a, int64_t begin, int64_t end);
void adam_range_avx2(const AdamArgs& a, int64_t begin, int64_t end);
void adam_range_avx512(const AdamArgs& a, int64_t begin, int64_t end);

}  // namespace zerostack
