// pybind11 binding of the CPU Adam kernel: no torch headers. Python
// validates the tensors and passes raw pointers, element counts and dtype
// codes; this file picks the SIMD level at run time, splits the work into
// blocks and runs them on a team of threads of its own with the GIL released.
//
// [Note: CPU Adam's blocks go to whichever thread is free] The team takes
// the blocks one at a time (the dynamic schedule), not a fixed 1/width of
// them each (the static one). In training the team shares the cores with
// threads that keep one busy: the thread driving the GPU (a CUDA
// synchronize spins), the device lane's, the copies'. With a fixed share,
// a team thread that shares a core finishes last and the whole step waits
// for it; with blocks taken as threads come free, the others take over its
// share. A block is 2^16 elements (about 1.3 MB of the step's traffic), so
// the one atomic increment per block costs nothing. Each element's result
// does not depend on the thread that computes it: both schedules give the
// same bits. `set_schedule("static")` (ZEROSTACK_CPU_ADAM_SCHEDULE) keeps
// the old one, for measuring the difference (docs/benchmarks.md).
//
// [Note: CPU Adam's threads sleep between calls] The team is this module's
// own (class Team below), not an OpenMP one. An OpenMP team of libgomp (the
// one torch loads, which every extension in the process shares) spins after
// each parallel region, by default for about 300,000 pause instructions, and
// OMP_WAIT_POLICY, which turns that off, is read once, when torch is
// imported. An offloaded step calls CPU Adam every few milliseconds (a chunk
// or a bucket at a time) on a worker thread while the main thread runs the
// next forward's Python and launches: 15 spinning team threads on a 16-core
// host took the cores that thread and the worker's own Python needed between
// the calls. On an H200 host (16 cores), the OpenMP kernel in processes that
// set OMP_WAIT_POLICY=PASSIVE before importing torch (idle threads asleep, as
// this team's are whatever the environment): LLaMA 1.1B under a 12 GiB cap
// 0.311 and 0.314 s a step against 0.324 and 0.358 s without it, the CPU step
// 0.147-0.149 s against 0.161-0.179 s; the 4.24B GPT under 24 GiB 1.187 s
// against 1.238 and 1.241 s (docs/benchmarks.md, "2026-12-05 twentieth session"). This
// team against the OpenMP kernel on an H100 host, alternating processes:
// LLaMA 0.306-0.331 s against 0.333-0.376 s, the CPU step 0.129-0.144 s
// against 0.156-0.185 s; the 4.24B a tie ("twenty-first session"). On the
// 2-core development machine, a worker stepping CPU Adam chunk by chunk
// beside a main thread running torch ops: 0.1213-0.1232 s against the OpenMP kernel's 0.1237-0.1247 s. Here the
// helpers wait asleep on a condition variable, whatever the environment
// says; waking them costs tens of microseconds a call. One call runs at a
// time (a second caller waits for the first: the kernel is bound by memory
// bandwidth, which two teams at once would share). The team is never
// destroyed (its threads are detached and sleep until the process ends), and
// a child made by fork() starts a new one: the parent's threads do not exist
// there.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
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

// See [Note: CPU Adam's threads sleep between calls].
class Team {
 public:
  using Body = std::function<void(int64_t)>;

  // body(i) for every i in [0, n), on `width` threads, the calling thread one
  // of them: items taken one at a time (dynamic) or `width` contiguous ranges.
  // `body` must not throw (the helpers still run it while an exception would
  // unwind the caller); the kernel's range functions do not.
  void run(int width, int64_t n, bool dynamic, const Body& body) {
    std::lock_guard<std::mutex> one_call(call_mu_);
    while (helpers_ < width - 1 && n > 1) {
      try {  // counted only once it exists: a call never waits for a missing helper
        std::thread(&Team::serve, this, helpers_ + 1).detach();
      } catch (const std::system_error&) {
        break;  // no more threads to be had (a process limit): the ones there are
      }
      ++helpers_;
    }
    width = std::min(width, helpers_ + 1);
    if (width <= 1 || n <= 1) {
      for (int64_t i = 0; i < n; ++i) body(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      body_ = &body;
      n_ = n;
      width_ = width;
      dynamic_ = dynamic;
      next_.store(0, std::memory_order_relaxed);
      running_ = width - 1;
      ++generation_;
    }
    start_.notify_all();  // helpers left out of a narrower call wake and sleep again
    work(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return running_ == 0; });
    body_ = nullptr;
  }

 private:
  void work(int member) {
    if (dynamic_) {
      for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*body_)(i);
    } else {
      const int64_t lo = n_ * member / width_, hi = n_ * (member + 1) / width_;
      for (int64_t i = lo; i < hi; ++i) (*body_)(i);
    }
  }

  // Helper `member` (1, 2, ...): asleep until a call wants it, then its share.
  // A call's helpers are all back here before the next call starts.
  void serve(int member) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      start_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (member >= width_) continue;  // not in this call's team
      lock.unlock();
      work(member);
      lock.lock();
      if (--running_ == 0) done_.notify_one();
    }
  }

  std::mutex call_mu_;  // one call at a time
  std::mutex mu_;       // what the helpers read, and `running_`
  std::condition_variable start_, done_;
  int helpers_ = 0;
  uint64_t generation_ = 0;
  const Body* body_ = nullptr;
  int64_t n_ = 0;
  int width_ = 1;
  bool dynamic_ = true;
  alignas(64) std::atomic<int64_t> next_{0};  // a cache line of its own: taken per block
  int running_ = 0;
};

// Never destroyed: detached helpers may still sleep in it at exit. After
// fork() the child gets a new one (the old one's helpers are not there).
Team* g_team = new Team();
const int kAtFork = pthread_atfork(nullptr, nullptr, [] { g_team = new Team(); });

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
  g_team->run(width, num_tasks, dynamic, [&](int64_t i) {
    fn(args[tasks[i].tensor], tasks[i].begin, tasks[i].end);
  });
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
}
