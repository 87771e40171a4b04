// One SIMD level of the CPU Adam kernel.
//
// This file is compiled three times by the build hook, once per level, with
// ZS_LEVEL set to 0 (scalar, plain x86-64), 1 (AVX2 + FMA + F16C) or 2
// (AVX-512F), and with only that level's -m flags. Everything here has
// internal linkage except the one entry point whose name carries the level,
// so the three copies never merge at link time (an inline helper compiled
// with -mavx512f must not be picked for the scalar path).
//
// Math (fp32 whatever the storage dtype): adam_math.h's adam_elem, which the
// scalar path calls and the vector paths repeat lane by lane, operation for
// operation (the same fused multiply-adds, nothing else fused: the build
// passes -ffp-contract=off), so every level and the CUDA kernel give the
// same bits. When an output buffer is given, the updated p is also written
// there cast to its dtype (the fused copy-out).

#include <cmath>
#include <cstdint>
#include <cstring>

#if ZS_LEVEL > 0
#include <immintrin.h>
#endif

#include "adam_cpu_kernel.h"

#if ZS_LEVEL == 2
#define ZS_ENTRY adam_range_avx512
#elif ZS_LEVEL == 1
#define ZS_ENTRY adam_range_avx2
#else
#define ZS_ENTRY adam_range_scalar
#endif

namespace {

using zerostack::AdamArgs;
using zerostack::kBF16;
using zerostack::kF16;
using zerostack::kF32;

// ---- scalar conversions (exact, round-to-nearest-even; also the tails) ----

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

template <int DT>
inline float load1(const void* base, int64_t i) {
  if constexpr (DT == kF32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (DT == kF16) {
    return static_cast<float>(static_cast<const _Float16*>(base)[i]);
  } else {
    return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
}

template <int DT>
inline void store1(void* base, int64_t i, float x) {
  if constexpr (DT == kF32) {
    static_cast<float*>(base)[i] = x;
  } else if constexpr (DT == kF16) {
    static_cast<_Float16*>(base)[i] = static_cast<_Float16>(x);
  } else {
    static_cast<uint16_t*>(base)[i] = f32_to_bf16(x);
  }
}

// ---- vector conversions ----

#if ZS_LEVEL == 2
constexpr int kWidth = 16;
using vf = __m512;

template <int DT>
inline vf loadv(const void* base, int64_t i) {
  if constexpr (DT == kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (DT == kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <int DT>
inline void storev(void* base, int64_t i, vf x) {
  if constexpr (DT == kF32) {
    _mm512_storeu_ps(static_cast<float*>(base) + i, x);
  } else {
    __m256i h;
    if constexpr (DT == kF16) {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      __m512i u = _mm512_castps_si512(x);
      __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(
          _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
      __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
      __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, quiet));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i), h);
  }
}

// Non-temporal store for the copy-out buffer, which this pass only writes:
// a plain store would first read each line in (write-allocate), 2 extra
// bytes per param on a 28-byte step. Needs the vector's natural alignment.
template <int DT>
inline void streamv(void* base, int64_t i, vf x) {
  if constexpr (DT == kF32) {
    _mm512_stream_ps(static_cast<float*>(base) + i, x);
  } else {
    alignas(32) uint16_t tmp[16];
    storev<DT>(tmp, 0, x);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                        _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp)));
  }
}
constexpr int kStreamAlign = 64;  // bytes of an fp32 vector; 16-bit vectors need half

inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf vsqrt(vf a) { return _mm512_sqrt_ps(a); }

#elif ZS_LEVEL == 1
constexpr int kWidth = 8;
using vf = __m256;

template <int DT>
inline vf loadv(const void* base, int64_t i) {
  if constexpr (DT == kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (DT == kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <int DT>
inline void storev(void* base, int64_t i, vf x) {
  if constexpr (DT == kF32) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, x);
  } else {
    __m128i h;
    if constexpr (DT == kF16) {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      __m256i u = _mm256_castps_si256(x);
      __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
      __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
      __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
      r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(nan));
      // Values are < 2^16, so the saturating pack is exact; it interleaves
      // the two 128-bit lanes, and the permute puts 64-bit words 0 and 2 first.
      __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      h = _mm256_castsi256_si128(packed);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), h);
  }
}

template <int DT>
inline void streamv(void* base, int64_t i, vf x) {
  if constexpr (DT == kF32) {
    _mm256_stream_ps(static_cast<float*>(base) + i, x);
  } else {
    alignas(16) uint16_t tmp[8];
    storev<DT>(tmp, 0, x);
    _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     _mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
  }
}
constexpr int kStreamAlign = 32;

inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vsqrt(vf a) { return _mm256_sqrt_ps(a); }
#endif

template <int PT, int GT, int OT>
void run(const AdamArgs& a, int64_t begin, int64_t end) {
  const zerostack::AdamScalars& s = a.s;
  float* m = a.exp_avg;
  float* v = a.exp_avg_sq;
  int64_t i = begin;
#if ZS_LEVEL > 0
  const vf vb1 = vset(s.beta1), vb2 = vset(s.beta2), v1b1 = vset(s.one_minus_beta1),
           v1b2 = vset(s.one_minus_beta2);
  const vf vgs = vset(s.grad_scale), vwd = vset(s.weight_decay), vdecay = vset(s.decay),
           veps = vset(s.eps);
  const vf vstep = vset(s.step_size), vibc2 = vset(s.inv_sqrt_bc2);
  bool stream_out = false;
  if constexpr (OT >= 0) {
    constexpr int elem = OT == kF32 ? 4 : 2;
    const uintptr_t first = reinterpret_cast<uintptr_t>(a.out) + begin * elem;
    stream_out = first % (kStreamAlign * elem / 4) == 0;
  }
  for (; i + kWidth <= end; i += kWidth) {
    vf g = vmul(loadv<GT>(a.grad, i), vgs);
    vf p = loadv<PT>(a.param, i);
    if (s.l2) g = vfma(vwd, p, g);
    vf mi = vfma(vb1, loadv<kF32>(m, i), vmul(v1b1, g));
    vf vi = vfma(vb2, loadv<kF32>(v, i), vmul(v1b2, vmul(g, g)));
    p = vmul(p, vdecay);
    vf denom = vfma(vsqrt(vi), vibc2, veps);
    p = vfnma(vstep, vdiv(mi, denom), p);
    storev<kF32>(m, i, mi);
    storev<kF32>(v, i, vi);
    storev<PT>(a.param, i, p);
    if constexpr (OT >= 0) {
      if (stream_out) {
        streamv<OT>(a.out, i, p);
      } else {
        storev<OT>(a.out, i, p);
      }
    }
  }
  if (stream_out) _mm_sfence();  // order the streamed stores before returning
#endif
  for (; i < end; ++i) {
    float p = load1<PT>(a.param, i);
    float mi = m[i], vi = v[i];
    zerostack::adam_elem(p, load1<GT>(a.grad, i), mi, vi, s);
    m[i] = mi;
    v[i] = vi;
    store1<PT>(a.param, i, p);
    if constexpr (OT >= 0) store1<OT>(a.out, i, p);
  }
}

template <int PT, int GT>
void dispatch_out(const AdamArgs& a, int64_t b, int64_t e) {
  switch (a.out_dtype) {
    case -1: return run<PT, GT, -1>(a, b, e);
    case kF32: return run<PT, GT, kF32>(a, b, e);
    case kF16: return run<PT, GT, kF16>(a, b, e);
    default: return run<PT, GT, kBF16>(a, b, e);
  }
}

template <int PT>
void dispatch_grad(const AdamArgs& a, int64_t b, int64_t e) {
  switch (a.grad_dtype) {
    case kF32: return dispatch_out<PT, kF32>(a, b, e);
    case kF16: return dispatch_out<PT, kF16>(a, b, e);
    default: return dispatch_out<PT, kBF16>(a, b, e);
  }
}

}  // namespace

namespace zerostack {

void ZS_ENTRY(const AdamArgs& a, int64_t begin, int64_t end) {
  switch (a.param_dtype) {
    case kF32: return dispatch_grad<kF32>(a, begin, end);
    case kF16: return dispatch_grad<kF16>(a, begin, end);
    default: return dispatch_grad<kBF16>(a, begin, end);
  }
}

}  // namespace zerostack
