// Shared between the per-level kernel objects and the binding.
#pragma once
#include <cstdint>

namespace zerostack {

// Dtype codes, the same on the Python side (zerostack.fused_adam._kernels).
constexpr int kF32 = 0;
constexpr int kF16 = 1;
constexpr int kBF16 = 2;

// One tensor's step: pointers, dtypes and the hyperparameters folded into
// the values the inner loop needs.
struct AdamArgs {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* out;  // nullptr when there is no copy-out
  int param_dtype;
  int grad_dtype;
  int out_dtype;  // -1 when out is nullptr
  float lr, beta1, beta2, eps, weight_decay;
  float one_minus_beta1, one_minus_beta2;  // formed in double, as torch and the CUDA kernel do
  float step_size;     // lr / bias_correction1
  float inv_sqrt_bc2;  // 1 / sqrt(bias_correction2)
  float grad_scale;    // 1 / div_scale, or 1
  bool adamw_mode;
};

void adam_range_scalar(const AdamArgs& a, int64_t begin, int64_t end);
void adam_range_avx2(const AdamArgs& a, int64_t begin, int64_t end);
void adam_range_avx512(const AdamArgs& a, int64_t begin, int64_t end);

}  // namespace zerostack
