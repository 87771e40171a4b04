// The Adam step's math, one statement for both kernels.
//
// The CPU kernel (its scalar path; the AVX2 and AVX-512 paths do the same
// operations lane by lane) and the CUDA kernel form their scalars here and
// step an element with adam_elem, so both give the same bits for the same
// inputs: every operation is one IEEE round-to-nearest operation, fused
// multiply-adds exactly where written, and the build forbids the compilers'
// own contractions (g++ -ffp-contract=off, nvcc -fmad=false). A share of the
// updates can then move between the CPU and the GPU (gpu_update_fraction)
// without changing a bit of the result.
//
// For each element, in fp32 whatever the storage dtype:
//   g = grad * grad_scale                      (grad_scale = 1 / div_scale, or the clip factor)
//   L2 mode (adamw_mode false, wd != 0):  g = fma(wd, p, g)
//   m = fma(beta1, m, (1 - beta1) * g)
//   v = fma(beta2, v, (1 - beta2) * (g * g))
//   p = p * decay                              (AdamW with wd != 0: decay = 1 - lr * wd, else 1)
//   p = fma(-step_size, m / fma(sqrt(v), inv_sqrt_bc2, eps), p)
// with step_size = lr / bias_correction1 and inv_sqrt_bc2 = 1 / sqrt(bias_correction2)
// formed in double and rounded once, as torch forms them from Python floats.
//
// Everything has internal linkage: the CPU kernel's file is compiled once per
// SIMD level, and an inline function compiled with -mavx512f must never be
// picked for the scalar level at link time.
#pragma once
#include <cmath>

#ifdef __CUDACC__
#define ZS_MATH __host__ __device__ static __forceinline__
#else
#define ZS_MATH static inline
#endif

namespace zerostack {

// The per-step scalars; 44 bytes, passed by value to the CUDA kernel.
struct AdamScalars {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float step_size;     // lr / bias_correction1
  float inv_sqrt_bc2;  // 1 / sqrt(bias_correction2)
  float grad_scale;
  float weight_decay;  // read in L2 mode only
  float decay;         // 1 - lr * weight_decay in AdamW mode, else 1
  int l2;              // adamw_mode false and weight_decay != 0
};

// Bias corrections must be > 0; the callers check and say so in their own words.
ZS_MATH AdamScalars adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                 double bias_correction1, double bias_correction2, bool adamw_mode,
                                 double grad_scale) {
  AdamScalars s;
  s.beta1 = static_cast<float>(beta1);
  // 1 - beta in float would be 1 - float(0.999) = 0.00099998713: 1.3e-5 off.
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.step_size = static_cast<float>(lr / bias_correction1);
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  s.grad_scale = static_cast<float>(grad_scale);
  s.weight_decay = static_cast<float>(weight_decay);
  const bool decoupled = adamw_mode && weight_decay != 0.0;
  s.decay = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  s.l2 = (!adamw_mode && weight_decay != 0.0) ? 1 : 0;
  return s;
}

ZS_MATH float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

ZS_MATH float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

ZS_MATH float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

ZS_MATH float sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// One element's step; p, m and v in fp32, g the stored gradient as fp32.
ZS_MATH void adam_elem(float& p, float g, float& m, float& v, const AdamScalars& s) {
  g = mul_rn(g, s.grad_scale);
  if (s.l2) g = fma_rn(s.weight_decay, p, g);
  m = fma_rn(s.beta1, m, mul_rn(s.one_minus_beta1, g));
  v = fma_rn(s.beta2, v, mul_rn(s.one_minus_beta2, mul_rn(g, g)));
  p = mul_rn(p, s.decay);
  p = fma_rn(-s.step_size, div_rn(m, fma_rn(sqrt_rn(v), s.inv_sqrt_bc2, s.eps)), p);
}

}  // namespace zerostack

#undef ZS_MATH
