// pybind11 binding of the CPU Adam kernel: no torch headers. Python
// validates the tensors and passes raw pointers, element counts and dtype
// codes; this file picks the SIMD level at run time, splits the work into
// blocks and runs them on an OpenMP team with the GIL released.
//
// [Note: CPU Adam's blocks go to whichever thread is free] The team takes
// the blocks one at a time (schedule(dynamic, 1)), not a fixed 1/width of
// them each (schedule(static)). In training the team shares the cores with
// threads that keep one busy: the thread driving the GPU (a CUDA
// synchronize spins), the device lane's, the copies'. With a fixed share,
// a team thread that shares a core finishes last and the whole step waits
// for it; with blocks taken as threads come free, the others take over its
// share. A block is 2^16 elements (about 1.3 MB of the step's traffic), so
// the one atomic increment per block costs nothing. Each element's result
// does not depend on the thread that computes it: both schedules give the
// same bits. `set_schedule("static")` (ZEROSTACK_CPU_ADAM_SCHEDULE) keeps
// the old one, for measuring the difference (docs/benchmarks.md).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_cpu_kernel.h"

namespace py = pybind11;
using zerostack::AdamArgs;

namespace {

enum Level { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
const char* kLevelNames[] = {"scalar", "avx2", "avx512"};

// Elements per work item: a multiple of every vector width, large enough
// that the per-block overhead vanishes, small enough to balance threads.
constexpr int64_t kBlock = 1 << 16;

int detect_level() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return kAvx2;
  }
  return kScalar;
}

const int kBestLevel = detect_level();
int g_level = kBestLevel;
bool g_dynamic = true;  // see [Note: CPU Adam's blocks go to whichever thread is free]

void set_schedule(const std::string& name) {
  if (name != "dynamic" && name != "static") {
    throw py::value_error("CPU Adam: unknown schedule '" + name + "'; use dynamic or static");
  }
  g_dynamic = name == "dynamic";
}

using RangeFn = void (*)(const AdamArgs&, int64_t, int64_t);

RangeFn range_fn(int level) {
  switch (level) {
    case kAvx512: return zerostack::adam_range_avx512;
    case kAvx2: return zerostack::adam_range_avx2;
    default: return zerostack::adam_range_scalar;
  }
}

std::vector<std::string> supported_levels() {
  std::vector<std::string> out;
  for (int l = kBestLevel; l >= 0; --l) out.emplace_back(kLevelNames[l]);
  return out;
}

void set_simd_level(const std::string& name) {
  for (int l = 0; l <= kAvx512; ++l) {
    if (name == kLevelNames[l]) {
      if (l > kBestLevel) {
        throw py::value_error("CPU Adam: SIMD level '" + name +
                              "' is not supported by this CPU (best is '" +
                              kLevelNames[kBestLevel] + "')");
      }
      g_level = l;
      return;
    }
  }
  throw py::value_error("CPU Adam: unknown SIMD level '" + name +
                        "'; use one of avx512, avx2, scalar");
}

void check_dtype(int code, const char* what, bool allow_none) {
  if ((allow_none && code == -1) || (code >= zerostack::kF32 && code <= zerostack::kBF16)) return;
  throw py::value_error(std::string("CPU Adam: bad ") + what + " dtype code " +
                        std::to_string(code));
}

void adam_step(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
               const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
               const std::vector<uintptr_t>& outs, const std::vector<int64_t>& numels,
               int param_dtype, int grad_dtype, int out_dtype, double lr, double beta1, double beta2,
               double eps, double weight_decay, double bias_correction1, double bias_correction2,
               bool adamw_mode, double grad_scale, int num_threads) {
  const size_t n = params.size();
  if (grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n ||
      numels.size() != n || (!outs.empty() && outs.size() != n)) {
    throw py::value_error("CPU Adam: tensor lists differ in length");
  }
  check_dtype(param_dtype, "param", false);
  check_dtype(grad_dtype, "grad", false);
  check_dtype(out_dtype, "out", true);
  if (outs.empty() != (out_dtype == -1)) {
    throw py::value_error("CPU Adam: out_dtype must be -1 exactly when outs is empty");
  }
  if (!(bias_correction1 > 0.0f) || !(bias_correction2 > 0.0f)) {
    throw py::value_error("CPU Adam: bias corrections must be positive");
  }

  const zerostack::AdamScalars scalars = zerostack::adam_scalars(
      lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2, adamw_mode, grad_scale);
  std::vector<AdamArgs> args(n);
  struct Task {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Task> tasks;
  for (size_t t = 0; t < n; ++t) {
    AdamArgs& a = args[t];
    a.param = reinterpret_cast<void*>(params[t]);
    a.grad = reinterpret_cast<const void*>(grads[t]);
    a.exp_avg = reinterpret_cast<float*>(exp_avgs[t]);
    a.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sqs[t]);
    a.out = outs.empty() ? nullptr : reinterpret_cast<void*>(outs[t]);
    a.param_dtype = param_dtype;
    a.grad_dtype = grad_dtype;
    a.out_dtype = out_dtype;
    a.s = scalars;
    for (int64_t b = 0; b < numels[t]; b += kBlock) {
      tasks.push_back({t, b, std::min(numels[t], b + kBlock)});
    }
  }

  const RangeFn fn = range_fn(g_level);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int width = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_tasks)));
  const bool dynamic = g_dynamic;
  py::gil_scoped_release nogil;
  if (dynamic) {
#pragma omp parallel for num_threads(width) schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) fn(args[tasks[i].tensor], tasks[i].begin, tasks[i].end);
  } else {
#pragma omp parallel for num_threads(width) schedule(static)
    for (int64_t i = 0; i < num_tasks; ++i) fn(args[tasks[i].tensor], tasks[i].begin, tasks[i].end);
  }
}

}  // namespace

PYBIND11_MODULE(_adam_cpu, m) {
  m.doc() = "zerostack CPU Adam kernel (torch-free; pointers in, run-time SIMD dispatch)";
  m.def("adam_step", &adam_step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("outs"), py::arg("numels"), py::arg("param_dtype"),
        py::arg("grad_dtype"), py::arg("out_dtype"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("bias_correction1"),
        py::arg("bias_correction2"), py::arg("adamw_mode"), py::arg("grad_scale"),
        py::arg("num_threads"));
  m.def("simd_level", []() { return std::string(kLevelNames[g_level]); });
  m.def("supported_levels", &supported_levels);
  m.def("set_simd_level", &set_simd_level, py::arg("name"));
  m.def("set_schedule", &set_schedule, py::arg("name"));
  m.def("schedule", []() { return std::string(g_dynamic ? "dynamic" : "static"); });
  m.def("max_threads", []() { return omp_get_max_threads(); });
}
