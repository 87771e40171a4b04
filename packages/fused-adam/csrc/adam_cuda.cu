// _adam_cuda: multi-tensor Adam / AdamW step for CUDA, torch-free (pybind11 only).
//
// What it does
//   One call steps a list of tensors. Python passes raw device pointers
//   (tensor.data_ptr()), element counts and dtype codes; the launch goes on
//   the caller's stream and nothing is allocated or copied per step. Each
//   element steps in fp32 whatever the storage dtype, by adam_math.h's
//   adam_elem (the CPU kernel's math, bit for bit),
//   then p is stored in the param dtype (round to nearest even), m and v in
//   fp32, and, with "fused copy-out", p again in the out dtype.
//
// Metadata (LaunchMeta, passed by value as a kernel argument)
//   kMaxSlots (64) tensor slots. Slot s holds the five base pointers
//   (param, grad, exp_avg, exp_avg_sq, out or null), the slot's element count
//   (int64) and block_start[s], the first block of the grid that works on it.
//   Slot s owns blocks [block_start[s], block_start[s + 1]); each block owns
//   one chunk of kChunk elements of its slot. Unused slots hold INT32_MAX in
//   block_start, so a block finds its slot with a fixed 6-step binary search
//   over the kernel-argument array (uniform constant-bank loads). Because the
//   map is a prefix array and not one entry per block, a launch is not capped
//   at a few hundred blocks (apex/torch: 320 blocks per launch, so a big model
//   takes thousands of launches each with its own drain tail): a launch ends
//   only when 64 slots are used or at kMaxBlocksPerLaunch blocks, where a
//   tensor is split and its next slot starts at an advanced base pointer.
//   sizeof(LaunchMeta) = 64 * (5 * 8 + 8 + 4) = 3328 B, sizeof(Hyper) = 44 B:
//   3372 B of kernel arguments, under the classic 4 KB limit (static_assert).
//
// Sizes
//   256 threads, and per iteration each thread moves kIlp (2) vectors of 4
//   elements per stream, the j-th at vector index base + j * 256 + tid, so
//   every warp-wide access is contiguous. A 4-element vector is 16 B for the
//   fp32 streams (m, v, fp32 p/g/out) and 8 B for fp16/bf16 streams; both
//   give whole 32-byte sectors, and one index serves every stream. With fp32
//   p and g a thread has 8 independent 16-byte loads in flight; launch bounds
//   (256, 4) cap registers at 64 (ptxas uses 55-60, no spills) so 1024
//   threads per SM are resident:
//   about 128 KB of loads in flight per SM, several times the
//   bandwidth-latency product (~4.8 TB/s * ~1.5 us / 132 SMs ~ 55 KB).
//   A chunk is 8192 elements (4 iterations, 229 KB of traffic in fp32, a
//   block lives ~30 us at 4 blocks/SM): the drain at the end of a launch is
//   bounded by one block's life (torch's 64K-element chunks: ~8x longer), and
//   the per-block slot lookup (6 dependent constant loads) is noise.
//   Vector path when every pointer of the tensor is aligned to its 4-element
//   vector (16 B fp32, 8 B 16-bit; chunk starts keep that alignment since
//   kChunk % 4 == 0), the last < 4 elements of a tensor scalar; a tensor with
//   any misaligned pointer takes a scalar path with the same ILP (8 loads per
//   stream in flight), still coalesced. Grads are read through the read-only
//   path (ld.global.nc); m and v are streamed (ld/st .cs, evict-first) since
//   only the optimizer touches them, so L2 keeps params, which the next
//   forward or all-gather reads.
//   All five knobs can be overridden with -DZS_ADAM_* for tuning.
//
// Indexing
//   Offsets inside a chunk are int (< kChunk); a chunk's start is computed in
//   int64 ((block - block_start) * kChunk) and added to the base pointers
//   once, so a tensor may exceed 2^31 elements. Block indices stay below
//   kMaxBlocksPerLaunch = 2^30 (< gridDim.x limit 2^31 - 1).
//
// Expected bound
//   DRAM traffic: fp32 p/g reads 4 x 4 B, writes 3 x 4 B = 28 B per param
//   (+2 B per param for a bf16/fp16 copy-out; 16-bit p and g: 22 B).
//   1e9 fp32 params -> 28 GB -> ~6.9 ms at 4.07 TB/s (H200 copy rate).
//
// The per-block body is __host__ __device__ and has no shared memory or
// barriers, so it can be emulated block by block on the CPU (define
// ZS_ADAM_NO_MODULE and include this file) to test the indexing without a GPU.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "adam_math.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifndef ZS_ADAM_NO_MODULE
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#endif

#ifndef ZS_ADAM_BLOCK_THREADS
#define ZS_ADAM_BLOCK_THREADS 256
#endif
#ifndef ZS_ADAM_ILP
#define ZS_ADAM_ILP 2
#endif
#ifndef ZS_ADAM_MIN_BLOCKS_PER_SM
#define ZS_ADAM_MIN_BLOCKS_PER_SM 4
#endif
#ifndef ZS_ADAM_CHUNK_NUMEL
#define ZS_ADAM_CHUNK_NUMEL 8192
#endif
#ifndef ZS_ADAM_MAX_BLOCKS_PER_LAUNCH
#define ZS_ADAM_MAX_BLOCKS_PER_LAUNCH (1 << 30)
#endif

#define ZS_ADAM_STR2(...) #__VA_ARGS__
#define ZS_ADAM_STR(...) ZS_ADAM_STR2(__VA_ARGS__)

namespace zs_adam {

constexpr int kBlock = ZS_ADAM_BLOCK_THREADS;
constexpr int kIlp = ZS_ADAM_ILP;                      // 4-element vectors per thread per iteration
constexpr int kScalarIlp = 4 * ZS_ADAM_ILP;            // elements per thread per iteration, scalar path
constexpr int kMinBlocksPerSm = ZS_ADAM_MIN_BLOCKS_PER_SM;
constexpr int kChunk = ZS_ADAM_CHUNK_NUMEL;            // elements per block
constexpr int kMaxSlots = 64;                          // tensors (or tensor pieces) per launch
constexpr int64_t kMaxBlocksPerLaunch = ZS_ADAM_MAX_BLOCKS_PER_LAUNCH;

static_assert(kBlock % 32 == 0 && kBlock <= 1024, "block size must be a whole number of warps");
static_assert(kIlp >= 1 && kIlp <= 8, "ILP out of range");
static_assert(kChunk % 4 == 0, "chunk starts must keep 4-element vector alignment");
static_assert(kChunk > 0 && kChunk <= (1 << 30), "in-chunk offsets are int");
static_assert((kMaxSlots & (kMaxSlots - 1)) == 0, "slot search assumes a power of two");
static_assert(kMaxBlocksPerLaunch >= 1 && kMaxBlocksPerLaunch < std::numeric_limits<int32_t>::max(),
              "block_start padding (INT32_MAX) must exceed every block index");

// Dtype codes shared with the Python caller.
enum DtypeCode : int { kNone = -1, kF32 = 0, kF16 = 1, kBF16 = 2 };

struct NoOut {};  // out type when there is no fused copy-out

struct LaunchMeta {
  void* param[kMaxSlots];
  const void* grad[kMaxSlots];
  float* exp_avg[kMaxSlots];
  float* exp_avg_sq[kMaxSlots];
  void* out[kMaxSlots];           // null when there is no copy-out
  int64_t numel[kMaxSlots];       // elements of this slot (a tensor, or the rest of a split one)
  int32_t block_start[kMaxSlots]; // first block of the slot; INT32_MAX for unused slots
};

using Hyper = zerostack::AdamScalars;

static_assert(sizeof(LaunchMeta) == kMaxSlots * (5 * 8 + 8 + 4), "unexpected LaunchMeta padding");
static_assert(sizeof(LaunchMeta) % alignof(Hyper) == 0, "Hyper follows LaunchMeta without padding");
static_assert(sizeof(LaunchMeta) + sizeof(Hyper) <= 4096, "kernel arguments must fit the classic 4 KB limit");

// ---------------------------------------------------------------------------
// Loads and stores. On the host (CPU emulation) every access is a plain one.

enum class Cache { kDefault, kReadOnly, kStreaming };

template <Cache C, class V>
__host__ __device__ __forceinline__ V ld(const V* p) {
#ifdef __CUDA_ARCH__
  if constexpr (C == Cache::kReadOnly) {
    return __ldg(p);
  } else if constexpr (C == Cache::kStreaming) {
    return __ldcs(p);
  } else {
    return *p;
  }
#else
  return *p;
#endif
}

template <Cache C, class V>
__host__ __device__ __forceinline__ void st(V* p, V x) {
#ifdef __CUDA_ARCH__
  if constexpr (C == Cache::kStreaming) {
    __stcs(p, x);
  } else {
    *p = x;
  }
#else
  *p = x;
#endif
}

// Storage traits: Bits is the type the memory holds, Vec4 four of them.
// Loads return raw Bits/Vec4; conversion to fp32 happens only in the compute
// phase, so nothing consumes a load inside the (guarded) load phase and all of
// a thread's loads are issued before the first one is waited on.
template <class T>
struct Io;

template <>
struct Io<float> {
  using Bits = float;
  using Vec4 = float4;  // 16 B
  __host__ __device__ __forceinline__ static float to_f(Bits b) { return b; }
  __host__ __device__ __forceinline__ static Bits from_f(float x) { return x; }
  __host__ __device__ __forceinline__ static void unpack(const Vec4& x, float (&r)[4]) {
    r[0] = x.x;
    r[1] = x.y;
    r[2] = x.z;
    r[3] = x.w;
  }
  __host__ __device__ __forceinline__ static Vec4 pack(const float (&r)[4]) {
    return make_float4(r[0], r[1], r[2], r[3]);
  }
};

// fp16 and bf16 share the 16-bit packing; Derived supplies the conversions.
template <class Derived>
struct Io16 {
  using Bits = unsigned short;
  using Vec4 = uint2;  // 8 B, little-endian: element 0 in the low half of .x
  __host__ __device__ __forceinline__ static void unpack(const Vec4& x, float (&r)[4]) {
    r[0] = Derived::to_f(static_cast<Bits>(x.x & 0xffffu));
    r[1] = Derived::to_f(static_cast<Bits>(x.x >> 16));
    r[2] = Derived::to_f(static_cast<Bits>(x.y & 0xffffu));
    r[3] = Derived::to_f(static_cast<Bits>(x.y >> 16));
  }
  __host__ __device__ __forceinline__ static Vec4 pack(const float (&r)[4]) {
    Vec4 x;
    x.x = static_cast<unsigned>(Derived::from_f(r[0])) | (static_cast<unsigned>(Derived::from_f(r[1])) << 16);
    x.y = static_cast<unsigned>(Derived::from_f(r[2])) | (static_cast<unsigned>(Derived::from_f(r[3])) << 16);
    return x;
  }
};

template <>
struct Io<__half> : Io16<Io<__half>> {
  __host__ __device__ __forceinline__ static float to_f(unsigned short b) {
    return __half2float(__ushort_as_half(b));
  }
  __host__ __device__ __forceinline__ static unsigned short from_f(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
};

template <>
struct Io<__nv_bfloat16> : Io16<Io<__nv_bfloat16>> {
  __host__ __device__ __forceinline__ static float to_f(unsigned short b) {
    return __bfloat162float(__ushort_as_bfloat16(b));
  }
  __host__ __device__ __forceinline__ static unsigned short from_f(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
};

template <>
struct Io<NoOut> {
  using Bits = unsigned char;  // never dereferenced
};

// ---------------------------------------------------------------------------
// The math, one element, fp32: adam_math.h's, the CPU kernel's.
using zerostack::adam_elem;

// One chunk of len (1..kChunk) elements; pointers already point at its start.
template <class P, class G, class O>
__host__ __device__ __forceinline__ void adam_chunk(typename Io<P>::Bits* __restrict__ p,
                                                    const typename Io<G>::Bits* __restrict__ g,
                                                    float* __restrict__ m, float* __restrict__ v,
                                                    typename Io<O>::Bits* __restrict__ o, int len,
                                                    const Hyper& h, int tid) {
  constexpr bool kOut = !std::is_same<O, NoOut>::value;
  constexpr uintptr_t kPMask = 4 * sizeof(typename Io<P>::Bits) - 1;
  constexpr uintptr_t kGMask = 4 * sizeof(typename Io<G>::Bits) - 1;
  constexpr uintptr_t kOMask = 4 * sizeof(typename Io<O>::Bits) - 1;
  uintptr_t misaligned = (reinterpret_cast<uintptr_t>(p) & kPMask) | (reinterpret_cast<uintptr_t>(g) & kGMask) |
                         ((reinterpret_cast<uintptr_t>(m) | reinterpret_cast<uintptr_t>(v)) & 15u);
  if constexpr (kOut) misaligned |= reinterpret_cast<uintptr_t>(o) & kOMask;

  if (misaligned == 0) {
    using PV = typename Io<P>::Vec4;
    using GV = typename Io<G>::Vec4;
    const int nvec = len >> 2;  // whole 4-element vectors in this chunk
    for (int base = 0; base < nvec; base += kBlock * kIlp) {
      PV rp[kIlp];
      GV rg[kIlp];
      float4 rm[kIlp], rv[kIlp];
#pragma unroll
      for (int j = 0; j < kIlp; ++j) {
        const int e = 4 * (base + j * kBlock + tid);  // first element of this vector
        if (e < 4 * nvec) {
          rp[j] = ld<Cache::kDefault>(reinterpret_cast<const PV*>(p + e));
          rg[j] = ld<Cache::kReadOnly>(reinterpret_cast<const GV*>(g + e));
          rm[j] = ld<Cache::kStreaming>(reinterpret_cast<const float4*>(m + e));
          rv[j] = ld<Cache::kStreaming>(reinterpret_cast<const float4*>(v + e));
        }
      }
#pragma unroll
      for (int j = 0; j < kIlp; ++j) {
        const int e = 4 * (base + j * kBlock + tid);
        if (e < 4 * nvec) {
          float fp[4], fg[4], fm[4], fv[4];
          Io<P>::unpack(rp[j], fp);
          Io<G>::unpack(rg[j], fg);
          Io<float>::unpack(rm[j], fm);
          Io<float>::unpack(rv[j], fv);
#pragma unroll
          for (int k = 0; k < 4; ++k) adam_elem(fp[k], fg[k], fm[k], fv[k], h);
          st<Cache::kDefault>(reinterpret_cast<PV*>(p + e), Io<P>::pack(fp));
          st<Cache::kStreaming>(reinterpret_cast<float4*>(m + e), Io<float>::pack(fm));
          st<Cache::kStreaming>(reinterpret_cast<float4*>(v + e), Io<float>::pack(fv));
          if constexpr (kOut) {
            using OV = typename Io<O>::Vec4;
            st<Cache::kDefault>(reinterpret_cast<OV*>(o + e), Io<O>::pack(fp));
          }
        }
      }
    }
    // Only a tensor's last chunk can have a tail, of at most 3 elements.
    const int i = 4 * nvec + tid;
    if (i < len) {
      float pf = Io<P>::to_f(p[i]);
      float mf = ld<Cache::kStreaming>(m + i);
      float vf = ld<Cache::kStreaming>(v + i);
      adam_elem(pf, Io<G>::to_f(ld<Cache::kReadOnly>(g + i)), mf, vf, h);
      p[i] = Io<P>::from_f(pf);
      st<Cache::kStreaming>(m + i, mf);
      st<Cache::kStreaming>(v + i, vf);
      if constexpr (kOut) o[i] = Io<O>::from_f(pf);
    }
  } else {
    // Some pointer of this tensor is not vector aligned: element-wise, same
    // number of loads in flight per thread.
    using PB = typename Io<P>::Bits;
    using GB = typename Io<G>::Bits;
    for (int base = 0; base < len; base += kBlock * kScalarIlp) {
      PB rp[kScalarIlp];
      GB rg[kScalarIlp];
      float rm[kScalarIlp], rv[kScalarIlp];
#pragma unroll
      for (int j = 0; j < kScalarIlp; ++j) {
        const int i = base + j * kBlock + tid;
        if (i < len) {
          rp[j] = p[i];
          rg[j] = ld<Cache::kReadOnly>(g + i);
          rm[j] = ld<Cache::kStreaming>(m + i);
          rv[j] = ld<Cache::kStreaming>(v + i);
        }
      }
#pragma unroll
      for (int j = 0; j < kScalarIlp; ++j) {
        const int i = base + j * kBlock + tid;
        if (i < len) {
          float pf = Io<P>::to_f(rp[j]);
          adam_elem(pf, Io<G>::to_f(rg[j]), rm[j], rv[j], h);
          p[i] = Io<P>::from_f(pf);
          st<Cache::kStreaming>(m + i, rm[j]);
          st<Cache::kStreaming>(v + i, rv[j]);
          if constexpr (kOut) o[i] = Io<O>::from_f(pf);
        }
      }
    }
  }
}

// Everything one block does: find its slot and chunk, then step the chunk.
template <class P, class G, class O>
__host__ __device__ __forceinline__ void adam_block(const LaunchMeta& meta, const Hyper& h, int block, int tid) {
  // Largest s with block_start[s] <= block (unused slots hold INT32_MAX).
  int s = 0;
#pragma unroll
  for (int step = kMaxSlots / 2; step > 0; step >>= 1) {
    if (meta.block_start[s + step] <= block) s += step;
  }
  const int64_t begin = static_cast<int64_t>(block - meta.block_start[s]) * kChunk;
  const int64_t left = meta.numel[s] - begin;  // > 0 by construction of block_start
  const int len = left < kChunk ? static_cast<int>(left) : kChunk;

  using PB = typename Io<P>::Bits;
  using GB = typename Io<G>::Bits;
  using OB = typename Io<O>::Bits;
  OB* o = nullptr;
  if constexpr (!std::is_same<O, NoOut>::value) o = static_cast<OB*>(meta.out[s]) + begin;
  adam_chunk<P, G, O>(static_cast<PB*>(meta.param[s]) + begin, static_cast<const GB*>(meta.grad[s]) + begin,
                      meta.exp_avg[s] + begin, meta.exp_avg_sq[s] + begin, o, len, h, tid);
}

template <class P, class G, class O>
__global__ void __launch_bounds__(kBlock, kMinBlocksPerSm) adam_kernel(const LaunchMeta meta, const Hyper h) {
  adam_block<P, G, O>(meta, h, static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x));
}

// ---------------------------------------------------------------------------
// Host side.

inline size_t dtype_size(int code) { return code == kF32 ? 4 : 2; }

struct StepArgs {
  const std::vector<uintptr_t>& params;
  const std::vector<uintptr_t>& grads;
  const std::vector<uintptr_t>& exp_avgs;
  const std::vector<uintptr_t>& exp_avg_sqs;
  const std::vector<uintptr_t>& outs;
  const std::vector<int64_t>& numels;
  int param_dtype, grad_dtype, out_dtype;
};

[[noreturn]] inline void fail(const std::string& what) { throw std::invalid_argument("multi_tensor_adam: " + what); }

inline void validate(const StepArgs& a) {
  const size_t n = a.params.size();
  auto check_len = [&](const char* name, size_t got) {
    if (got != n) {
      fail(std::string(name) + " has a different length from params (got len(" + name + ")=" +
           std::to_string(got) + ", len(params)=" + std::to_string(n) + "); pass one entry per tensor in every list");
    }
  };
  check_len("grads", a.grads.size());
  check_len("exp_avgs", a.exp_avgs.size());
  check_len("exp_avg_sqs", a.exp_avg_sqs.size());
  check_len("numels", a.numels.size());
  auto check_dtype = [&](const char* name, int code) {
    if (code != kF32 && code != kF16 && code != kBF16) {
      fail(std::string("bad ") + name + " (got " + std::to_string(code) +
           "); use 0 (float32), 1 (float16) or 2 (bfloat16)");
    }
  };
  check_dtype("param_dtype", a.param_dtype);
  check_dtype("grad_dtype", a.grad_dtype);
  if (a.outs.empty()) {
    if (a.out_dtype != kNone) {
      fail("out_dtype is set but outs is empty (got out_dtype=" + std::to_string(a.out_dtype) +
           "); pass out_dtype=-1 without outs, or one out pointer per tensor");
    }
  } else {
    check_len("outs", a.outs.size());
    if (a.out_dtype == kNone) {
      fail("outs is given but out_dtype is -1 (got len(outs)=" + std::to_string(a.outs.size()) +
           "); pass the out dtype code 0, 1 or 2");
    }
    check_dtype("out_dtype", a.out_dtype);
  }
  // A bad pointer would fault on the device and poison the whole CUDA context,
  // so catch the cheap cases here.
  auto check_ptr = [&](const char* name, size_t i, uintptr_t ptr, size_t elem) {
    if (ptr == 0) {
      fail(std::string(name) + "[" + std::to_string(i) + "] is a null pointer (got 0 for a tensor of " +
           std::to_string(a.numels[i]) + " elements); pass tensor.data_ptr() of a CUDA tensor");
    }
    if (ptr % elem != 0) {
      fail(std::string(name) + "[" + std::to_string(i) + "] is not aligned to its " + std::to_string(elem) +
           "-byte element (got " + std::to_string(ptr) + "); pass the data_ptr() of a tensor of that dtype");
    }
  };
  for (size_t i = 0; i < n; ++i) {
    if (a.numels[i] < 0) {
      fail("numels[" + std::to_string(i) + "] is negative (got " + std::to_string(a.numels[i]) +
           "); pass tensor.numel()");
    }
    if (a.numels[i] == 0) continue;
    check_ptr("params", i, a.params[i], dtype_size(a.param_dtype));
    check_ptr("grads", i, a.grads[i], dtype_size(a.grad_dtype));
    check_ptr("exp_avgs", i, a.exp_avgs[i], 4);
    check_ptr("exp_avg_sqs", i, a.exp_avg_sqs[i], 4);
    if (!a.outs.empty()) check_ptr("outs", i, a.outs[i], dtype_size(a.out_dtype));
  }
}

inline Hyper make_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                        double bias_correction1, double bias_correction2, bool adamw_mode, double grad_scale) {
  if (!(bias_correction1 > 0.0) || !(bias_correction2 > 0.0)) {
    std::ostringstream os;
    os << "multi_tensor_adam: bias corrections must be > 0 (got bias_correction1=" << bias_correction1
       << ", bias_correction2=" << bias_correction2
       << "); pass 1 - beta**step with step >= 1 and beta < 1, or 1.0 when bias correction is off";
    throw std::invalid_argument(os.str());
  }
  return zerostack::adam_scalars(lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2,
                                  adamw_mode, grad_scale);
}

inline void reset(LaunchMeta& meta) {
  for (int s = 0; s < kMaxSlots; ++s) {
    meta.param[s] = nullptr;
    meta.grad[s] = nullptr;
    meta.exp_avg[s] = nullptr;
    meta.exp_avg_sq[s] = nullptr;
    meta.out[s] = nullptr;
    meta.numel[s] = 0;
    meta.block_start[s] = std::numeric_limits<int32_t>::max();
  }
}

// Packs the tensors into launches and calls launch(meta, num_blocks) for each.
// Zero-numel tensors are skipped; a tensor is split across launches when a
// launch reaches max_blocks (its next piece starts at advanced pointers, which
// keeps alignment since kChunk % 4 == 0).
template <class LaunchFn>
void plan_launches(const StepArgs& a, int64_t max_blocks, LaunchFn&& launch) {
  const bool has_out = !a.outs.empty();
  const uint64_t ps = dtype_size(a.param_dtype);
  const uint64_t gs = dtype_size(a.grad_dtype);
  const uint64_t os = has_out ? dtype_size(a.out_dtype) : 0;
  LaunchMeta meta;
  reset(meta);
  int slots = 0;
  int64_t blocks = 0;
  for (size_t i = 0; i < a.params.size(); ++i) {
    const int64_t numel = a.numels[i];
    int64_t done = 0;
    while (done < numel) {
      const int64_t remaining = numel - done;
      const int64_t chunks = (remaining + kChunk - 1) / kChunk;
      const int64_t take_chunks = chunks < max_blocks - blocks ? chunks : max_blocks - blocks;
      const int64_t take = remaining < take_chunks * kChunk ? remaining : take_chunks * kChunk;
      const uint64_t off = static_cast<uint64_t>(done);
      meta.param[slots] = reinterpret_cast<void*>(a.params[i] + off * ps);
      meta.grad[slots] = reinterpret_cast<const void*>(a.grads[i] + off * gs);
      meta.exp_avg[slots] = reinterpret_cast<float*>(a.exp_avgs[i] + off * 4);
      meta.exp_avg_sq[slots] = reinterpret_cast<float*>(a.exp_avg_sqs[i] + off * 4);
      meta.out[slots] = has_out ? reinterpret_cast<void*>(a.outs[i] + off * os) : nullptr;
      meta.numel[slots] = take;
      meta.block_start[slots] = static_cast<int32_t>(blocks);
      ++slots;
      blocks += take_chunks;
      done += take;
      if (slots == kMaxSlots || blocks == max_blocks) {
        launch(static_cast<const LaunchMeta&>(meta), static_cast<int>(blocks));
        reset(meta);
        slots = 0;
        blocks = 0;
      }
    }
  }
  if (slots > 0) launch(static_cast<const LaunchMeta&>(meta), static_cast<int>(blocks));
}

using Launcher = void (*)(const LaunchMeta&, const Hyper&, int, cudaStream_t);

template <class P, class G, class O>
void launch_adam(const LaunchMeta& meta, const Hyper& h, int blocks, cudaStream_t stream) {
  adam_kernel<P, G, O><<<blocks, kBlock, 0, stream>>>(meta, h);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("multi_tensor_adam: kernel launch failed: ") + cudaGetErrorString(err) +
                             " (" + cudaGetErrorName(err) +
                             "); tensors of earlier launches in this call may already be stepped");
  }
}

template <class P, class G>
Launcher pick_out(int out_dtype) {
  switch (out_dtype) {
    case kNone: return &launch_adam<P, G, NoOut>;
    case kF32: return &launch_adam<P, G, float>;
    case kF16: return &launch_adam<P, G, __half>;
    case kBF16: return &launch_adam<P, G, __nv_bfloat16>;
    default: fail("bad out_dtype (got " + std::to_string(out_dtype) + "); use -1, 0, 1 or 2");
  }
}

template <class P>
Launcher pick_grad(int grad_dtype, int out_dtype) {
  switch (grad_dtype) {
    case kF32: return pick_out<P, float>(out_dtype);
    case kF16: return pick_out<P, __half>(out_dtype);
    case kBF16: return pick_out<P, __nv_bfloat16>(out_dtype);
    default: fail("bad grad_dtype (got " + std::to_string(grad_dtype) + "); use 0, 1 or 2");
  }
}

inline Launcher pick_launcher(int param_dtype, int grad_dtype, int out_dtype) {
  switch (param_dtype) {
    case kF32: return pick_grad<float>(grad_dtype, out_dtype);
    case kF16: return pick_grad<__half>(grad_dtype, out_dtype);
    case kBF16: return pick_grad<__nv_bfloat16>(grad_dtype, out_dtype);
    default: fail("bad param_dtype (got " + std::to_string(param_dtype) + "); use 0, 1 or 2");
  }
}

inline void multi_tensor_adam(uintptr_t stream, const std::vector<uintptr_t>& params,
                              const std::vector<uintptr_t>& grads, const std::vector<uintptr_t>& exp_avgs,
                              const std::vector<uintptr_t>& exp_avg_sqs, const std::vector<uintptr_t>& outs,
                              const std::vector<int64_t>& numels, int param_dtype, int grad_dtype, int out_dtype,
                              double lr, double beta1, double beta2, double eps, double weight_decay,
                              double bias_correction1, double bias_correction2, bool adamw_mode,
                              double grad_scale) {
  const StepArgs a{params, grads, exp_avgs, exp_avg_sqs, outs, numels, param_dtype, grad_dtype, out_dtype};
  validate(a);
  const Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2, adamw_mode,
                             grad_scale);
  if (params.empty()) return;
  const Launcher launcher = pick_launcher(param_dtype, grad_dtype, out_dtype);
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  plan_launches(a, kMaxBlocksPerLaunch, [&](const LaunchMeta& meta, int blocks) { launcher(meta, h, blocks, s); });
}

inline std::string device_info() {
  std::ostringstream os;
  os << "_adam_cuda: nvcc " << __CUDACC_VER_MAJOR__ << "." << __CUDACC_VER_MINOR__;
#ifdef __CUDA_ARCH_LIST__
  os << ", arch list " << ZS_ADAM_STR(__CUDA_ARCH_LIST__);
#endif
  os << ", cudart (static) " << CUDART_VERSION;
  os << "; block " << kBlock << ", ilp " << kIlp << "x4, chunk " << kChunk << ", min blocks/SM " << kMinBlocksPerSm
     << ", slots/launch " << kMaxSlots << ", kernel args " << sizeof(LaunchMeta) + sizeof(Hyper) << " B";
  int driver = 0;
  if (cudaDriverGetVersion(&driver) == cudaSuccess) os << "; driver " << driver;
  int dev = -1;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) {
    int major = 0, minor = 0, sms = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    os << "; device " << dev << " sm_" << major << minor << ", " << sms << " SMs";
    cudaFuncAttributes attr{};
    err = cudaFuncGetAttributes(&attr, adam_kernel<float, float, NoOut>);
    if (err == cudaSuccess) {
      os << "; fp32 kernel: binary sm_" << attr.binaryVersion << ", ptx " << attr.ptxVersion << ", "
         << attr.numRegs << " regs, " << attr.localSizeBytes << " B local";
    }
  }
  if (err != cudaSuccess) os << "; no usable device (" << cudaGetErrorString(err) << ")";
  (void)cudaGetLastError();  // leave no error behind for the next launch check
  return os.str();
}

}  // namespace zs_adam

#ifndef ZS_ADAM_NO_MODULE
namespace py = pybind11;

PYBIND11_MODULE(_adam_cuda, m) {
  m.doc() = "Multi-tensor Adam/AdamW CUDA kernel on raw device pointers (zerostack.fused_adam).";
  m.def("multi_tensor_adam", &zs_adam::multi_tensor_adam, py::arg("stream"), py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("outs"), py::arg("numels"), py::arg("param_dtype"),
        py::arg("grad_dtype"), py::arg("out_dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("bias_correction1"), py::arg("bias_correction2"),
        py::arg("adamw_mode"), py::arg("grad_scale"), py::call_guard<py::gil_scoped_release>(),
        "One Adam/AdamW step over many tensors, launched on `stream` (no synchronisation).\n\n"
        "Pointers are device addresses (tensor.data_ptr()); exp_avgs/exp_avg_sqs are float32;\n"
        "dtype codes: 0 float32, 1 float16, 2 bfloat16; out_dtype -1 when outs is empty.\n"
        "Raises ValueError on inconsistent arguments, RuntimeError when a launch fails.");
  m.def("device_info", &zs_adam::device_info, "Build and device facts (no kernel launch).");
  m.attr("CHUNK_NUMEL") = zs_adam::kChunk;
  m.attr("BLOCK_THREADS") = zs_adam::kBlock;
  m.attr("MAX_TENSORS_PER_LAUNCH") = zs_adam::kMaxSlots;
}
#endif
