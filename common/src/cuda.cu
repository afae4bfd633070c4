// cuda: devices (cuda.hpp) and the device side of tensors and communicators
// (kernels.hpp). Compiled with --default-stream per-thread, so each rank's thread works
// on a stream of its own.
//
// cuBLAS is not linked: it is opened the first time a matmul runs on a GPU (gpu_library.hpp
// says why).
//
// Every kernel here has a host loop beside it in tensor.cpp / comm.cpp, and test_cuda.cpp
// checks each against it on random data before anything is timed (llm.c's pattern).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gpu_check.hpp"
#include "gpu_library.hpp"
#include "kernels.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"

namespace shardlab {

// ---------------------------------------------------------------------------
// Devices

namespace cuda {

bool built() { return true; }

int device_count() {
  // Asked once: the answer, or why a GPU that is there cannot be used.
  static const std::pair<int, std::string> probe = [] {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess) return std::pair<int, std::string>{n, ""};
    cudaGetLastError();  // clear it
    return std::pair<int, std::string>{
        0, start_failure(static_cast<int>(e),
                         std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e))};
  }();
  if (!probe.second.empty()) throw Error(probe.second);
  return probe.first;
}

namespace {
int attribute(cudaDeviceAttr a, int index) {
  int v = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&v, a, index));
  return v;
}
/// FP32 lanes per SM, by compute capability (CUDA C Programming Guide, "Arithmetic
/// Instructions" throughput table).
int fp32_lanes(int major, int minor) {
  if (major == 7) return 64;                     // Volta, Turing
  if (major == 8) return minor == 0 ? 64 : 128;  // A100; Ampere GA10x, Ada
  if (major >= 9) return 128;                    // Hopper, Blackwell
  return 0;
}
}  // namespace

std::string describe_device(int index) {
  if (index < 0 || index >= device_count()) return "no CUDA device " + std::to_string(index);
  cudaDeviceProp p{};
  CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  return std::string(p.name) + ", sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " + std::to_string(p.totalGlobalMem >> 30) +
         " GiB";
}

double peak_fp32_tflops(int index) {
  const int major = attribute(cudaDevAttrComputeCapabilityMajor, index);
  const int minor = attribute(cudaDevAttrComputeCapabilityMinor, index);
  const double sms = attribute(cudaDevAttrMultiProcessorCount, index);
  const double khz = attribute(cudaDevAttrClockRate, index);
  return sms * fp32_lanes(major, minor) * khz * 1e3 * 2.0 / 1e12;
}

void set_device(int index) { CUDA_CHECK(cudaSetDevice(index)); }

int current_device() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return d;
}

int device_for_rank(int rank) {
  const int n = device_count();
  if (n == 0) throw UsageError("--device cuda: no CUDA device found");
  return rank % n;
}

void synchronize() { CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread)); }

EventTimer::EventTimer() {
  cudaEvent_t b = nullptr, e = nullptr;
  CUDA_CHECK(cudaEventCreate(&b));
  if (const cudaError_t err = cudaEventCreate(&e); err != cudaSuccess) {
    cudaEventDestroy(b);
    CUDA_CHECK(err);
  }
  begin_ = b, end_ = e;
}
EventTimer::~EventTimer() {
  cudaEventDestroy(static_cast<cudaEvent_t>(begin_));
  cudaEventDestroy(static_cast<cudaEvent_t>(end_));
}
void EventTimer::start() {
  CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(begin_), cudaStreamPerThread));
}
double EventTimer::stop() {
  const auto e = static_cast<cudaEvent_t>(end_);
  CUDA_CHECK(cudaEventRecord(e, cudaStreamPerThread));
  CUDA_CHECK(cudaEventSynchronize(e));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(begin_), e));
  return static_cast<double>(ms) / 1e3;
}

}  // namespace cuda

// ---------------------------------------------------------------------------
// Kernels

namespace kernels {

namespace {
constexpr int threads = 256;
cudaStream_t stream() { return cudaStreamPerThread; }

unsigned blocks(std::int64_t n) {
  return static_cast<unsigned>(std::min<std::int64_t>((n + threads - 1) / threads, 65535));
}

/// Launches kernel<<<blocks(n), threads>>> on the thread's stream, and nothing at all for
/// n == 0 (a grid of zero blocks is an error): every launch goes through here.
template <class... Params, class... Args>
void launch(std::int64_t n, void (*kernel)(Params...), Args... args) {
  if (n <= 0) return;
  kernel<<<blocks(n), threads, 0, stream()>>>(args...);
  CUDA_CHECK(cudaGetLastError());
}

#define GRID_STRIDE(i, n)                                                             \
  for (std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < (n); \
       i += std::int64_t{gridDim.x} * blockDim.x)

// Element loads and stores through double, for kernels written once for every type.
template <class T>
__device__ double load(const T* p, std::int64_t i) {
  if constexpr (std::is_same_v<T, Half>)
    return __half2float(__ushort_as_half(p[i].bits));
  else if constexpr (std::is_same_v<T, BFloat16>)
    return __bfloat162float(__ushort_as_bfloat16(p[i].bits));
  else
    return static_cast<double>(p[i]);
}
template <class T>
__device__ void store(T* p, std::int64_t i, double v) {
  if constexpr (std::is_same_v<T, Half>)
    p[i].bits = __half_as_ushort(__float2half_rn(static_cast<float>(v)));
  else if constexpr (std::is_same_v<T, BFloat16>)
    p[i].bits = __bfloat16_as_ushort(__float2bfloat16_rn(static_cast<float>(v)));
  else
    p[i] = static_cast<T>(v);
}

__global__ void binary_kernel(Binary op, const float* a, const float* b, float* out,
                              std::int64_t n) {
  GRID_STRIDE(i, n) {
    out[i] = op == Binary::add ? a[i] + b[i] : op == Binary::sub ? a[i] - b[i] : a[i] * b[i];
  }
}
__global__ void axpy_kernel(float alpha, const float* x, float* y, std::int64_t n) {
  GRID_STRIDE(i, n) { y[i] += alpha * x[i]; }
}
__global__ void scale_kernel(float* x, float s, std::int64_t n) {
  GRID_STRIDE(i, n) { x[i] *= s; }
}
__global__ void add_row_kernel(float* y, const float* row, std::int64_t n, std::int64_t cols) {
  GRID_STRIDE(i, n) { y[i] += row[i % cols]; }
}
/// One thread per column, summing down the rows in order (as the host loop does).
__global__ void column_sums_kernel(const float* x, float* out, std::int64_t rows,
                                   std::int64_t cols) {
  GRID_STRIDE(j, cols) {
    float sum = 0.0f;
    for (std::int64_t i = 0; i < rows; ++i) sum += x[i * cols + j];
    out[j] = sum;
  }
}
__global__ void tanh_kernel(const float* x, float* y, std::int64_t n) {
  GRID_STRIDE(i, n) { y[i] = tanhf(x[i]); }
}
__global__ void tanh_backward_kernel(const float* y, const float* dy, float* dx, std::int64_t n) {
  GRID_STRIDE(i, n) { dx[i] = dy[i] * (1.0f - y[i] * y[i]); }
}
constexpr float gelu_c = 0.7978845608028654f, gelu_a = 0.044715f;
__global__ void gelu_kernel(const float* x, float* y, std::int64_t n) {
  GRID_STRIDE(i, n) {
    const float v = x[i];
    y[i] = v / (1.0f + expf(-2.0f * (gelu_c * (v + gelu_a * v * v * v))));  // x sigmoid(2u)
  }
}
__global__ void gelu_backward_kernel(const float* x, const float* dy, float* dx, std::int64_t n) {
  GRID_STRIDE(i, n) {
    const float v = x[i];
    const float s = 1.0f / (1.0f + expf(-2.0f * (gelu_c * (v + gelu_a * v * v * v))));
    const float du = gelu_c * (1.0f + 3.0f * gelu_a * v * v);
    dx[i] = dy[i] * (s + 2.0f * v * s * (1.0f - s) * du);
  }
}
__global__ void adam_kernel(float* p, const float* g, float* m, float* v, std::int64_t n,
                            float m_weight, float v_keep, float v_weight, float step_size,
                            float correction2_sqrt, float eps, float l2, float keep) {
  GRID_STRIDE(i, n) {
    float grad = g[i];
    if (l2 != 0.0f) grad = __fadd_rn(grad, __fmul_rn(l2, p[i]));
    if (keep != 1.0f) p[i] = __fmul_rn(p[i], keep);
    const float d = __fsub_rn(grad, m[i]);  // ATen's lerp, without fused multiply-adds
    m[i] = fabsf(m_weight) < 0.5f ? __fadd_rn(m[i], __fmul_rn(m_weight, d))
                                  : __fsub_rn(grad, __fmul_rn(d, __fsub_rn(1.0f, m_weight)));
    v[i] = __fadd_rn(__fmul_rn(v[i], v_keep), __fmul_rn(__fmul_rn(v_weight, grad), grad));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v[i]), correction2_sqrt), eps);
    p[i] = __fadd_rn(p[i], __fdiv_rn(__fmul_rn(-step_size, m[i]), denom));
  }
}
template <class In, class Out>
__global__ void cast_kernel(const In* in, Out* out, std::int64_t n) {
  GRID_STRIDE(i, n) { store(out, i, load(in, i)); }
}
template <class T>
__global__ void fill_kernel(T* p, std::int64_t n, double value) {
  GRID_STRIDE(i, n) { store(p, i, value); }
}
__global__ void transpose_kernel(const unsigned char* src, unsigned char* dst, std::int64_t rows,
                                 std::int64_t cols, std::size_t elem) {
  GRID_STRIDE(i, rows * cols) {
    const std::int64_t r = i / cols, c = i % cols;
    for (std::size_t b = 0; b < elem; ++b) dst[(c * rows + r) * elem + b] = src[i * elem + b];
  }
}
/// Each block writes max |a - b| (|a| when b is null) of its elements to partial[block];
/// NaN wins.
template <class T>
__global__ void max_abs_diff_kernel(const T* a, const T* b, double* partial, std::int64_t n) {
  __shared__ double best[threads];
  double m = 0.0;
  GRID_STRIDE(i, n) {
    const double d = fabs(load(a, i) - (b ? load(b, i) : 0.0));
    m = (d != d || m != m) ? d + m : fmax(m, d);
  }
  best[threadIdx.x] = m;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const double o = best[threadIdx.x + stride], s = best[threadIdx.x];
      best[threadIdx.x] = (o != o || s != s) ? o + s : fmax(s, o);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = best[0];
}
template <class I>
__global__ void gather_kernel(const unsigned char* src, std::int64_t src_rows,
                              std::size_t row_bytes, const I* index, std::int64_t n,
                              unsigned char* out, int* bad) {
  GRID_STRIDE(k, n * static_cast<std::int64_t>(row_bytes)) {
    const std::int64_t i = k / static_cast<std::int64_t>(row_bytes);
    const std::int64_t b = k % static_cast<std::int64_t>(row_bytes);
    const std::int64_t r = index[i];
    if (r < 0 || r >= src_rows) {
      *bad = 1;
      continue;
    }
    out[k] = src[r * static_cast<std::int64_t>(row_bytes) + b];
  }
}
/// One thread per column, the rows added in order of i: the same sums as the host loop.
template <class I>
__global__ void scatter_add_kernel(float* dst, std::int64_t dst_rows, std::int64_t cols,
                                   const I* index, std::int64_t n, const float* src, int* bad) {
  GRID_STRIDE(j, cols) {
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t r = index[i];
      if (r < 0 || r >= dst_rows) {
        *bad = 1;
        continue;
      }
      dst[r * cols + j] += src[i * cols + j];
    }
  }
}
template <class T>
__global__ void reduce_kernel(T* acc, const T* x, std::int64_t n, ReduceOp op) {
  GRID_STRIDE(i, n) {
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        acc[i] = static_cast<T>(acc[i] + x[i]);
        break;
      case ReduceOp::max:  // x > acc, or x is NaN: NaN, once in, stays
        if (x[i] > acc[i] || x[i] != x[i]) acc[i] = x[i];
        break;
      case ReduceOp::min:
        if (x[i] < acc[i] || x[i] != x[i]) acc[i] = x[i];
        break;
    }
  }
}
template <class T>
__global__ void divide_kernel(T* acc, std::int64_t n, int ranks) {
  GRID_STRIDE(i, n) { acc[i] = static_cast<T>(acc[i] / ranks); }  // int division for ints
}

// -- layers ---------------------------------------------------------------------------
// Kernels that reduce over a row work one block per row: the block's threads share the row's
// elements (j = threadIdx.x, + blockDim.x, ...), then combine their partial results in shared
// memory. Every float operation that nn.cpp's host loop does is written as an intrinsic
// (__fmul_rn, __fadd_rn, ...): nvcc would otherwise fuse a multiply and an add, which the
// host build (-ffp-contract=off) never does.

/// Rows r = blockIdx.x, + gridDim.x, ...: the same for every thread of a block, so a
/// __syncthreads inside the loop is reached by all of them.
#define ROW_STRIDE(r, rows) for (std::int64_t r = blockIdx.x; r < (rows); r += gridDim.x)
/// This thread's share of a row's elements 0..count-1.
#define THREAD_STRIDE(j, count) for (std::int64_t j = threadIdx.x; j < (count); j += blockDim.x)

/// op over every thread's v (blockDim.x == threads, a power of two), for every thread: a
/// tree in shared memory, the same tree whatever the data.
template <class T, class Op>
__device__ T block_reduce(T v, T* shared, Op op) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride)
      shared[threadIdx.x] = op(shared[threadIdx.x], shared[threadIdx.x + stride]);
    __syncthreads();
  }
  const T total = shared[0];
  __syncthreads();  // before `shared` is written again
  return total;
}
struct AddDouble {
  __device__ double operator()(double a, double b) const { return __dadd_rn(a, b); }
};
struct MaxFloat {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
/// The sum of every thread's v, for every thread.
__device__ double block_sum(double v, double* shared) {
  return block_reduce(v, shared, AddDouble{});
}
/// The largest of every thread's v, for every thread.
__device__ float block_max(float v, float* shared) { return block_reduce(v, shared, MaxFloat{}); }

/// One block per row i of x (rows x cols): mean and variance in double, then y.
__global__ void layernorm_forward_kernel(const float* x, const float* gamma, const float* beta,
                                         float* y, float* mean, float* rstd, std::int64_t rows,
                                         std::int64_t cols, float eps) {
  __shared__ double partial[threads];
  ROW_STRIDE(i, rows) {
    const float* row = x + i * cols;
    double sum = 0.0;
    THREAD_STRIDE(j, cols) { sum = __dadd_rn(sum, static_cast<double>(row[j])); }
    const double m = block_sum(sum, partial) / static_cast<double>(cols);
    double var = 0.0;
    THREAD_STRIDE(j, cols) {
      const double d = __dsub_rn(static_cast<double>(row[j]), m);
      var = __dadd_rn(var, __dmul_rn(d, d));
    }
    var = block_sum(var, partial) / static_cast<double>(cols);
    const auto s = static_cast<float>(1.0 / sqrt(var + static_cast<double>(eps)));
    const auto mf = static_cast<float>(m);
    if (threadIdx.x == 0) {
      mean[i] = mf;
      rstd[i] = s;
    }
    THREAD_STRIDE(j, cols) {
      y[i * cols + j] =
          __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(row[j], mf), s), gamma[j]), beta[j]);
    }
  }
}

/// One block per row i: the row's mean(g) and mean(g xhat) in double, then dx.
__global__ void layernorm_backward_input_kernel(const float* x, const float* mean,
                                                const float* rstd, const float* gamma,
                                                const float* dy, float* dx, std::int64_t rows,
                                                std::int64_t cols) {
  __shared__ double partial[threads];
  ROW_STRIDE(i, rows) {
    const float m = mean[i], s = rstd[i];
    double sum_g = 0.0, sum_gx = 0.0;
    THREAD_STRIDE(j, cols) {
      const float xhat = __fmul_rn(__fsub_rn(x[i * cols + j], m), s);
      const float g = __fmul_rn(dy[i * cols + j], gamma[j]);
      sum_g = __dadd_rn(sum_g, static_cast<double>(g));
      sum_gx = __dadd_rn(sum_gx, __dmul_rn(static_cast<double>(g), static_cast<double>(xhat)));
    }
    const auto mean_g = static_cast<float>(block_sum(sum_g, partial) / static_cast<double>(cols));
    const auto mean_gx = static_cast<float>(block_sum(sum_gx, partial) / static_cast<double>(cols));
    THREAD_STRIDE(j, cols) {
      const float xhat = __fmul_rn(__fsub_rn(x[i * cols + j], m), s);
      const float g = __fmul_rn(dy[i * cols + j], gamma[j]);
      dx[i * cols + j] = __fmul_rn(s, __fsub_rn(__fsub_rn(g, mean_g), __fmul_rn(xhat, mean_gx)));
    }
  }
}

/// One thread per column j, adding the rows in order (as the host loop does).
__global__ void layernorm_backward_weight_kernel(const float* x, const float* mean,
                                                 const float* rstd, const float* dy, float* dgamma,
                                                 float* dbeta, std::int64_t rows,
                                                 std::int64_t cols) {
  GRID_STRIDE(j, cols) {
    float dg = dgamma[j], db = dbeta[j];
    for (std::int64_t i = 0; i < rows; ++i) {
      const float d = dy[i * cols + j];
      const float xhat = __fmul_rn(__fsub_rn(x[i * cols + j], mean[i]), rstd[i]);
      dg = __fadd_rn(dg, __fmul_rn(d, xhat));
      db = __fadd_rn(db, d);
    }
    dgamma[j] = dg;
    dbeta[j] = db;
  }
}

/// Attention's row r = (b * H + h) * T + t of the weights (B x H x T x T), as its sequence b,
/// head h and token t. In x, head h of sequence b starts at x + b T 3C + h 3D, and token s's
/// q, k, v lie s * 3C further on, D apart.
struct AttentionRow {
  std::int64_t b, h, t;
  __device__ AttentionRow(std::int64_t r, std::int64_t T, std::int64_t H)
      : b(r / (T * H)), h((r / T) % H), t(r % T) {}
};

/// One block per (b, h, t): the scores q_t . k_s * scale for s = 0..t written into att's row,
/// softmax over them in place, then y_t = sum_s att[s] v_s, one thread per channel.
__global__ void attention_forward_kernel(const float* x, float* y, float* att, std::int64_t B,
                                         std::int64_t T, std::int64_t H, std::int64_t D,
                                         float scale) {
  __shared__ float partial[threads];
  __shared__ float row_sum;
  const std::int64_t C = H * D;
  ROW_STRIDE(r, B * H * T) {
    const AttentionRow at(r, T, H);
    const float* head = x + at.b * T * 3 * C + at.h * 3 * D;  // token s's q at head + s * 3C
    const float* q = head + at.t * 3 * C;
    float* a = att + r * T;
    float top = -INFINITY;
    THREAD_STRIDE(s, at.t + 1) {
      const float* k = head + s * 3 * C + D;
      float dot = 0.0f;
      for (std::int64_t d = 0; d < D; ++d) dot = __fadd_rn(dot, __fmul_rn(q[d], k[d]));
      a[s] = __fmul_rn(dot, scale);
      top = fmaxf(top, a[s]);
    }
    top = block_max(top, partial);  // also makes every a[s] visible to every thread
    THREAD_STRIDE(s, at.t + 1) { a[s] = expf(__fsub_rn(a[s], top)); }
    __syncthreads();
    if (threadIdx.x == 0) {  // summed in order of s, as the host loop does
      float sum = 0.0f;
      for (std::int64_t s = 0; s <= at.t; ++s) sum = __fadd_rn(sum, a[s]);
      row_sum = sum;
    }
    __syncthreads();
    const float sum = row_sum;
    THREAD_STRIDE(s, at.t + 1) { a[s] = __fdiv_rn(a[s], sum); }
    __syncthreads();
    float* out = y + (at.b * T + at.t) * C + at.h * D;
    THREAD_STRIDE(d, D) {
      float acc = 0.0f;
      for (std::int64_t s = 0; s <= at.t; ++s)
        acc = __fadd_rn(acc, __fmul_rn(a[s], head[s * 3 * C + 2 * D + d]));
      out[d] = acc;
    }
    __syncthreads();  // before the next row writes row_sum
  }
}

/// One block per query (b, h, t): da_s = g_t . v_s, dscore_s = a_s (da_s - sum_s a_s da_s)
/// * scale (written into dscore's row), then dq_t = sum_s dscore_s k_s, one thread per channel.
__global__ void attention_backward_query_kernel(const float* x, const float* att, const float* dy,
                                                float* dscore, float* dx, std::int64_t B,
                                                std::int64_t T, std::int64_t H, std::int64_t D,
                                                float scale) {
  __shared__ float row_weighted;
  const std::int64_t C = H * D;
  ROW_STRIDE(r, B * H * T) {
    const AttentionRow at(r, T, H);
    const float* head = x + at.b * T * 3 * C + at.h * 3 * D;
    const float* a = att + r * T;
    float* ds = dscore + r * T;
    const float* g = dy + (at.b * T + at.t) * C + at.h * D;
    THREAD_STRIDE(s, at.t + 1) {
      const float* v = head + s * 3 * C + 2 * D;
      float dot = 0.0f;
      for (std::int64_t d = 0; d < D; ++d) dot = __fadd_rn(dot, __fmul_rn(g[d], v[d]));
      ds[s] = dot;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // sum_s a_s da_s, in order of s
      float weighted = 0.0f;
      for (std::int64_t s = 0; s <= at.t; ++s)
        weighted = __fadd_rn(weighted, __fmul_rn(a[s], ds[s]));
      row_weighted = weighted;
    }
    __syncthreads();
    const float weighted = row_weighted;
    THREAD_STRIDE(s, at.t + 1) {
      ds[s] = __fmul_rn(__fmul_rn(a[s], __fsub_rn(ds[s], weighted)), scale);
    }
    __syncthreads();
    float* dq = dx + (at.b * T + at.t) * 3 * C + at.h * 3 * D;
    THREAD_STRIDE(d, D) {
      float acc = 0.0f;
      for (std::int64_t s = 0; s <= at.t; ++s)
        acc = __fadd_rn(acc, __fmul_rn(ds[s], head[s * 3 * C + D + d]));
      dq[d] = acc;
    }
    __syncthreads();  // before the next row writes row_weighted
  }
}

/// One thread per (b, h, s, d) of the keys and values: dk_s = sum_{t >= s} dscore_ts q_t and
/// dv_s = sum_{t >= s} a_ts g_t, over t in order (as the host loop adds them).
__global__ void attention_backward_key_value_kernel(const float* x, const float* att,
                                                    const float* dy, const float* dscore, float* dx,
                                                    std::int64_t B, std::int64_t T, std::int64_t H,
                                                    std::int64_t D) {
  const std::int64_t C = H * D;
  GRID_STRIDE(i, B * H * T * D) {
    const std::int64_t d = i % D;
    const AttentionRow at(i / D, T, H);  // its t is the key's token s
    const std::int64_t s = at.t;
    const float* head = x + at.b * T * 3 * C + at.h * 3 * D;
    const std::int64_t scores = (at.b * H + at.h) * T * T;  // att[b][h] starts here
    float dk = 0.0f, dv = 0.0f;
    for (std::int64_t t = s; t < T; ++t) {
      const std::int64_t ts = scores + t * T + s;
      dk = __fadd_rn(dk, __fmul_rn(dscore[ts], head[t * 3 * C + d]));
      dv = __fadd_rn(dv, __fmul_rn(att[ts], dy[(at.b * T + t) * C + at.h * D + d]));
    }
    float* key = dx + (at.b * T + s) * 3 * C + at.h * 3 * D + D;
    key[d] = dk;
    key[D + d] = dv;
  }
}

/// One block per row i: the softmax of the logits into probs, the sum of exponentials in
/// double, and the row's loss top + log(sum) - logit[target].
template <class I>
__global__ void cross_entropy_kernel(const float* logits, const I* targets, float* probs,
                                     double* row_loss, std::int64_t rows, std::int64_t cols) {
  __shared__ float partial_max[threads];
  __shared__ double partial_sum[threads];
  ROW_STRIDE(i, rows) {
    const float* z = logits + i * cols;
    float* p = probs + i * cols;
    float top = -INFINITY;
    THREAD_STRIDE(j, cols) { top = fmaxf(top, z[j]); }
    top = block_max(top, partial_max);
    double sum = 0.0;
    THREAD_STRIDE(j, cols) {
      p[j] = expf(__fsub_rn(z[j], top));
      sum = __dadd_rn(sum, static_cast<double>(p[j]));
    }
    sum = block_sum(sum, partial_sum);
    THREAD_STRIDE(j, cols) { p[j] = static_cast<float>(__ddiv_rn(static_cast<double>(p[j]), sum)); }
    if (threadIdx.x == 0) {
      const std::int64_t target = targets[i];
      row_loss[i] = target >= 0 && target < cols
                        ? __dsub_rn(__dadd_rn(static_cast<double>(top), log(sum)),
                                    static_cast<double>(z[target]))
                        : nan("");
    }
  }
}

template <class I>
__global__ void subtract_one_at_targets_kernel(float* d, const I* targets, std::int64_t rows,
                                               std::int64_t cols) {
  GRID_STRIDE(i, rows) {
    const std::int64_t target = targets[i];
    if (target >= 0 && target < cols) d[i * cols + target] = __fsub_rn(d[i * cols + target], 1.0f);
  }
}

/// Launches kernel<<<one block per row (at most 65535; ROW_STRIDE takes the rest), threads>>>
/// on the thread's stream, and nothing for rows == 0.
template <class... Params, class... Args>
void launch_rows(std::int64_t rows, void (*kernel)(Params...), Args... args) {
  if (rows <= 0) return;
  const auto grid = static_cast<unsigned>(std::min<std::int64_t>(rows, 65535));
  kernel<<<grid, threads, 0, stream()>>>(args...);
  CUDA_CHECK(cudaGetLastError());
}

/// A small device flag for kernels that report a bad index.
class Flag {
 public:
  Flag() {
    CUDA_CHECK(cudaMalloc(&flag_, sizeof(int)));
    CUDA_CHECK(cudaMemsetAsync(flag_, 0, sizeof(int), stream()));
  }
  ~Flag() { cudaFree(flag_); }
  Flag(const Flag&) = delete;
  Flag& operator=(const Flag&) = delete;
  int* get() { return flag_; }
  bool raised() {
    int host = 0;
    CUDA_CHECK(cudaMemcpyAsync(&host, flag_, sizeof(int), cudaMemcpyDeviceToHost, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    return host != 0;
  }

 private:
  int* flag_ = nullptr;
};

/// Calls f(T{}) for the index types.
template <class F>
void visit_index(DType t, F&& f) {
  if (t == DType::i32)
    f(std::int32_t{});
  else
    f(std::int64_t{});
}

// The cuBLAS functions this file calls, opened on first use (the lookup is thread-safe).
// clang-format off
#define SHARDLAB_CUBLAS_FUNCTIONS(X) \
  X(cublasCreate) X(cublasDestroy) X(cublasSetStream) X(cublasSetMathMode) \
  X(cublasSgemm) X(cublasGetStatusString)
// clang-format on
struct Cublas {
  SHARDLAB_GPU_DECLARE(SHARDLAB_CUBLAS_FUNCTIONS)
  // For C++, cublas_api.h overloads cublasGemmEx with an inline wrapper (for the older
  // cudaDataType compute type), so its type is spelled out: the library's own function.
  cublasStatus_t (*cublasGemmEx)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                 int, const void*, const void*, cudaDataType, int, const void*,
                                 cudaDataType, int, const void*, void*, cudaDataType, int,
                                 cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};
const Cublas& cublas() {
  static const Cublas api = [] {
    void* lib = gpu::open_library("cuBLAS", {SHARDLAB_CUBLAS_SONAME, SHARDLAB_CUBLAS_PATH});
    Cublas c;
    SHARDLAB_GPU_BIND(SHARDLAB_CUBLAS_FUNCTIONS, c, lib, "cuBLAS");
    gpu::bind(lib, c.cublasGemmEx, "cuBLAS", "cublasGemmEx");
    return c;
  }();
  return api;
}

int device_of(const void* p) {
  cudaPointerAttributes a{};
  CUDA_CHECK(cudaPointerGetAttributes(&a, p));
  return a.type == cudaMemoryTypeDevice ? a.device : -1;
}

/// One cuBLAS handle per thread and device (each rank's thread has its own), bound to the
/// thread's stream, with the math mode set explicitly (FP32: no TF32), destroyed when the
/// thread ends.
class Handles {
 public:
  ~Handles() {
    for (auto& [device, handle] : handles_) cublas().cublasDestroy(handle);
  }
  cublasHandle_t get() {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    for (auto& [d, h] : handles_)
      if (d == device) return h;
    cublasHandle_t h = nullptr;
    CUBLAS_CHECK(cublas().cublasCreate(&h));
    CUBLAS_CHECK(cublas().cublasSetStream(h, stream()));
    CUBLAS_CHECK(cublas().cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
    handles_.emplace_back(device, h);
    return h;
  }

 private:
  std::vector<std::pair<int, cublasHandle_t>> handles_;
};
thread_local Handles handles;
}  // namespace

// -- memory -------------------------------------------------------------------------

void* device_alloc(std::size_t bytes, int* device) {
  void* p = nullptr;
  CUDA_CHECK(cudaGetDevice(device));
  CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

void device_free(void* p) {
  if (p) cudaFree(p);
}

void copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0 || dst == src) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream()));
  CUDA_CHECK(cudaStreamSynchronize(stream()));
}

void copy_2d(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
             std::size_t width, std::size_t height) {
  CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDefault,
                               stream()));
  CUDA_CHECK(cudaStreamSynchronize(stream()));
}

void zero(void* p, std::size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream()));
}

void fill(void* p, std::int64_t n, DType type, double value) {
  visit_dtype(type, [&](auto z) {
    using T = decltype(z);
    launch(n, fill_kernel<T>, static_cast<T*>(p), n, value);
  });
}

void transpose(const void* src, void* dst, std::int64_t rows, std::int64_t cols, std::size_t elem) {
  launch(rows * cols, transpose_kernel, static_cast<const unsigned char*>(src),
         static_cast<unsigned char*>(dst), rows, cols, elem);
}

// -- elementwise --------------------------------------------------------------------------

void binary(Binary op, const float* a, const float* b, float* out, std::int64_t n) {
  launch(n, binary_kernel, op, a, b, out, n);
}
void axpy(float alpha, const float* x, float* y, std::int64_t n) {
  launch(n, axpy_kernel, alpha, x, y, n);
}
void scale(float* x, float s, std::int64_t n) { launch(n, scale_kernel, x, s, n); }
void add_row(float* y, const float* row, std::int64_t rows, std::int64_t cols) {
  launch(rows * cols, add_row_kernel, y, row, rows * cols, cols);
}
void column_sums(const float* x, float* out, std::int64_t rows, std::int64_t cols) {
  launch(cols, column_sums_kernel, x, out, rows, cols);
}
void tanh_forward(const float* x, float* y, std::int64_t n) { launch(n, tanh_kernel, x, y, n); }
void tanh_backward(const float* y, const float* dy, float* dx, std::int64_t n) {
  launch(n, tanh_backward_kernel, y, dy, dx, n);
}
void gelu_forward(const float* x, float* y, std::int64_t n) { launch(n, gelu_kernel, x, y, n); }
void gelu_backward(const float* x, const float* dy, float* dx, std::int64_t n) {
  launch(n, gelu_backward_kernel, x, dy, dx, n);
}
void adam_step(float* p, const float* g, float* m, float* v, std::int64_t n, float m_weight,
               float v_keep, float v_weight, float step_size, float correction2_sqrt, float eps,
               float l2, float keep) {
  launch(n, adam_kernel, p, g, m, v, n, m_weight, v_keep, v_weight, step_size, correction2_sqrt,
         eps, l2, keep);
}

// -- layers -------------------------------------------------------------------------------

void layernorm_forward(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                       float* rstd, std::int64_t rows, std::int64_t cols, float eps) {
  launch_rows(rows, layernorm_forward_kernel, x, gamma, beta, y, mean, rstd, rows, cols, eps);
}
void layernorm_backward_input(const float* x, const float* mean, const float* rstd,
                              const float* gamma, const float* dy, float* dx, std::int64_t rows,
                              std::int64_t cols) {
  launch_rows(rows, layernorm_backward_input_kernel, x, mean, rstd, gamma, dy, dx, rows, cols);
}
void layernorm_backward_weight(const float* x, const float* mean, const float* rstd,
                               const float* dy, float* dgamma, float* dbeta, std::int64_t rows,
                               std::int64_t cols) {
  launch(cols, layernorm_backward_weight_kernel, x, mean, rstd, dy, dgamma, dbeta, rows, cols);
}
void attention_forward(const float* x, float* y, float* att, std::int64_t batch,
                       std::int64_t sequence, std::int64_t heads, std::int64_t head_size,
                       float scale) {
  launch_rows(batch * heads * sequence, attention_forward_kernel, x, y, att, batch, sequence, heads,
              head_size, scale);
}
void attention_backward(const float* x, const float* att, const float* dy, float* dscore, float* dx,
                        std::int64_t batch, std::int64_t sequence, std::int64_t heads,
                        std::int64_t head_size, float scale) {
  // Queries first: the keys' and values' kernel reads the dscore rows it writes (one stream).
  launch_rows(batch * heads * sequence, attention_backward_query_kernel, x, att, dy, dscore, dx,
              batch, sequence, heads, head_size, scale);
  launch(batch * heads * sequence * head_size, attention_backward_key_value_kernel, x, att, dy,
         static_cast<const float*>(dscore), dx, batch, sequence, heads, head_size);
}
void cross_entropy_forward(const float* logits, const void* targets, DType target_type,
                           float* probs, double* row_loss, std::int64_t rows, std::int64_t cols) {
  visit_index(target_type, [&](auto z) {
    using I = decltype(z);
    launch_rows(rows, cross_entropy_kernel<I>, logits, static_cast<const I*>(targets), probs,
                row_loss, rows, cols);
  });
}
void cross_entropy_backward(float* d, const void* targets, DType target_type, std::int64_t rows,
                            std::int64_t cols) {
  visit_index(target_type, [&](auto z) {
    using I = decltype(z);
    launch(rows, subtract_one_at_targets_kernel<I>, d, static_cast<const I*>(targets), rows, cols);
  });
}

// -- types and indices ----------------------------------------------------------------------

void cast(const void* in, DType from, void* out, DType to, std::int64_t n) {
  visit_dtype(from, [&](auto a) {
    using A = decltype(a);
    visit_dtype(to, [&](auto b) {
      using B = decltype(b);
      launch(n, cast_kernel<A, B>, static_cast<const A*>(in), static_cast<B*>(out), n);
    });
  });
}

double max_abs_diff(const void* a, const void* b, DType type, std::int64_t n) {
  if (n == 0) return 0.0;
  const unsigned n_blocks = std::min<unsigned>(blocks(n), 1024);
  double* partial = nullptr;
  CUDA_CHECK(cudaMalloc(&partial, n_blocks * sizeof(double)));
  visit_dtype(type, [&](auto z) {
    using T = decltype(z);
    max_abs_diff_kernel<T><<<n_blocks, threads, 0, stream()>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), partial, n);
  });
  std::vector<double> host(n_blocks);
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t copied = cudaMemcpyAsync(host.data(), partial, n_blocks * sizeof(double),
                                             cudaMemcpyDeviceToHost, stream());
  const cudaError_t synced = cudaStreamSynchronize(stream());
  cudaFree(partial);
  CUDA_CHECK(launched);
  CUDA_CHECK(copied);
  CUDA_CHECK(synced);
  double m = 0.0;
  for (double v : host) {
    if (std::isnan(v)) return v;
    m = std::max(m, v);
  }
  return m;
}

bool all_finite(const void* x, DType type, std::int64_t n) {
  return std::isfinite(max_abs_diff(x, nullptr, type, n));
}

bool index_rows(const void* src, std::int64_t src_rows, std::size_t row_bytes, const void* index,
                DType index_type, std::int64_t n, void* out) {
  Flag bad;
  visit_index(index_type, [&](auto z) {
    using I = decltype(z);
    launch(n * static_cast<std::int64_t>(row_bytes), gather_kernel<I>,
           static_cast<const unsigned char*>(src), src_rows, row_bytes,
           static_cast<const I*>(index), n, static_cast<unsigned char*>(out), bad.get());
  });
  return !bad.raised();
}

bool scatter_add_rows(float* dst, std::int64_t dst_rows, std::int64_t cols, const void* index,
                      DType index_type, std::int64_t n, const float* src) {
  Flag bad;
  visit_index(index_type, [&](auto z) {
    using I = decltype(z);
    launch(cols, scatter_add_kernel<I>, dst, dst_rows, cols, static_cast<const I*>(index), n, src,
           bad.get());
  });
  return !bad.raised();
}

// -- matmul ---------------------------------------------------------------------------

void matmul(const void* a, const void* b, void* out, DType type, std::int64_t M, std::int64_t N,
            std::int64_t K, bool transpose_a, bool transpose_b, std::int64_t a_cols,
            std::int64_t b_cols) {
  // cuBLAS is column-major, and a row-major R x C matrix is, to it, the C x R transpose.
  // So it computes out^T (N x M) = op(b)^T (N x K) @ op(a)^T (K x M): b first, then a; an
  // operand we want untransposed is passed as it lies (OP_N), one we want transposed with
  // OP_T. Leading dimensions are the row-major column counts.
  const float one = 1.0f, zero = 0.0f;
  const cublasOperation_t op_b = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasHandle_t h = handles.get();
  if (type == DType::f32) {
    CUBLAS_CHECK(cublas().cublasSgemm(
        h, op_b, op_a, static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &one,
        static_cast<const float*>(b), static_cast<int>(b_cols), static_cast<const float*>(a),
        static_cast<int>(a_cols), &zero, static_cast<float*>(out), static_cast<int>(N)));
    return;
  }
  // f16 / bf16 in and out, f32 accumulation: the tensor-core path.
  const cudaDataType_t t = type == DType::f16 ? CUDA_R_16F : CUDA_R_16BF;
  CUBLAS_CHECK(cublas().cublasGemmEx(h, op_b, op_a, static_cast<int>(N), static_cast<int>(M),
                                     static_cast<int>(K), &one, b, t, static_cast<int>(b_cols), a,
                                     t, static_cast<int>(a_cols), &zero, out, t,
                                     static_cast<int>(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// -- reductions for the communicators -----------------------------------------------------

void reduce_into(void* acc, const void* x, std::size_t count, DType type, ReduceOp op) {
  if (count == 0) return;
  const std::size_t bytes = count * dtype_size(type);
  int here = 0;
  CUDA_CHECK(cudaGetDevice(&here));
  // A kernel reads only its own device's memory: bring x over first if it lives elsewhere.
  void* staged = nullptr;
  if (device_of(x) != here) {
    CUDA_CHECK(cudaMalloc(&staged, bytes));
    copy(staged, x, bytes);
    x = staged;
  }
  const auto n = static_cast<std::int64_t>(count);
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      if (staged) cudaFree(staged);
      throw Error("reduce_into: f16 and bf16 are reduced through f32");
    } else {
      launch(n, reduce_kernel<T>, static_cast<T*>(acc), static_cast<const T*>(x), n, op);
    }
  });
  synchronize();
  if (staged) cudaFree(staged);
}

void finish_reduce(void* acc, std::size_t count, DType type, ReduceOp op, int ranks) {
  if (op != ReduceOp::avg || count == 0) return;
  const auto n = static_cast<std::int64_t>(count);
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
      throw Error("finish_reduce: f16 and bf16 are reduced through f32");
    else
      launch(n, divide_kernel<T>, static_cast<T*>(acc), n, ranks);
  });
  synchronize();
}

void synchronize() { CUDA_CHECK(cudaStreamSynchronize(stream())); }

}  // namespace kernels

const char* gpu::cublas_status_string(cublasStatus_t s) {
  return kernels::cublas().cublasGetStatusString(s);
}

}  // namespace shardlab
