// cuda: devices, device memory, kernels and cuBLAS (see cuda.hpp). Compiled with
// --default-stream per-thread, so each rank's thread works on a stream of its own.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gpu_check.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"

namespace shardlab::cuda {

// ---------------------------------------------------------------------------
// Devices

bool built() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the error, report none
    return 0;
  }
  return n;
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

int device_for_rank(int rank) {
  const int n = device_count();
  if (n == 0) throw UsageError("--device cuda: no CUDA device found");
  return rank % n;
}

void synchronize() { CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread)); }

// ---------------------------------------------------------------------------
// Device memory

DeviceTensor::DeviceTensor(std::int64_t rows, std::int64_t cols) : rows_(rows), cols_(cols) {
  require(rows >= 0 && cols >= 0, "DeviceTensor: negative size");
  if (size() == 0) return;
  CUDA_CHECK(cudaMalloc(&data_, static_cast<std::size_t>(size()) * sizeof(float)));
  CUDA_CHECK(cudaMemsetAsync(data_, 0, static_cast<std::size_t>(size()) * sizeof(float),
                             cudaStreamPerThread));
}

DeviceTensor::~DeviceTensor() {
  if (data_) cudaFree(data_);
}

DeviceTensor::DeviceTensor(DeviceTensor&& o) noexcept
    : data_(o.data_), rows_(o.rows_), cols_(o.cols_) {
  o.data_ = nullptr;
  o.rows_ = o.cols_ = 0;
}

DeviceTensor& DeviceTensor::operator=(DeviceTensor&& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(rows_, o.rows_);
  std::swap(cols_, o.cols_);
  return *this;
}

DeviceTensor DeviceTensor::to_device(const Tensor& host) {
  DeviceTensor d(host.ndim() == 2 ? host.rows() : 1, host.ndim() == 2 ? host.cols() : host.size());
  copy(d.data(), host.data(), static_cast<std::size_t>(host.size()) * sizeof(float));
  return d;
}

Tensor DeviceTensor::to_host() const {
  Tensor t(rows_, cols_);
  copy(t.data(), data_, static_cast<std::size_t>(size()) * sizeof(float));
  return t;
}

DeviceHalves::DeviceHalves(std::size_t count, HalfKind kind) : count_(count), kind_(kind) {
  if (count) CUDA_CHECK(cudaMalloc(&data_, count * sizeof(std::uint16_t)));
}
DeviceHalves::~DeviceHalves() {
  if (data_) cudaFree(data_);
}
DeviceHalves::DeviceHalves(DeviceHalves&& o) noexcept
    : data_(o.data_), count_(o.count_), kind_(o.kind_) {
  o.data_ = nullptr;
  o.count_ = 0;
}
DeviceHalves& DeviceHalves::operator=(DeviceHalves&& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(count_, o.count_);
  std::swap(kind_, o.kind_);
  return *this;
}
std::vector<std::uint16_t> DeviceHalves::to_host() const {
  std::vector<std::uint16_t> h(count_);
  copy(h.data(), data_, count_ * sizeof(std::uint16_t));
  return h;
}

void copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStreamPerThread));
  CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
}

// ---------------------------------------------------------------------------
// Kernels: grid-stride loops, one thread per element.

namespace {
constexpr int threads = 256;
unsigned blocks(std::int64_t n) {
  return static_cast<unsigned>(std::min<std::int64_t>((n + threads - 1) / threads, 65535));
}
void launched() { CUDA_CHECK(cudaGetLastError()); }

__global__ void axpy_kernel(float alpha, const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    y[i] += alpha * x[i];
}
__global__ void scale_kernel(float* x, float s, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    x[i] *= s;
}
__global__ void add_kernel(const float* a, const float* b, float* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    out[i] = a[i] + b[i];
}
__global__ void tanh_kernel(const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    y[i] = tanhf(x[i]);
}
__global__ void tanh_backward_kernel(const float* y, const float* dy, float* dx, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    dx[i] = dy[i] * (1.0f - y[i] * y[i]);
}
__global__ void adam_kernel(float* p, const float* g, float* m, float* v, float lr, float b1,
                            float b2, float eps, float correction1, float correction2,
                            std::int64_t n) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    p[i] -= lr * (m[i] / correction1) / (sqrtf(v[i] / correction2) + eps);
  }
}
/// Each block writes the max |a - b| of its elements (NaN if any is NaN) to partial[block].
__global__ void max_abs_diff_kernel(const float* a, const float* b, float* partial,
                                    std::int64_t n) {
  __shared__ float best[threads];
  float m = 0.0f;
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const float d = fabsf(a[i] - b[i]);
    m = (d != d || m != m) ? d + m : fmaxf(m, d);  // NaN wins
  }
  best[threadIdx.x] = m;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float o = best[threadIdx.x + stride], s = best[threadIdx.x];
      best[threadIdx.x] = (o != o || s != s) ? o + s : fmaxf(s, o);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = best[0];
}
__global__ void add_row_kernel(float* y, const float* row, std::int64_t n, std::int64_t cols) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    y[i] += row[i % cols];
}
/// One thread per column, summing down the rows in order (as the CPU reference does).
__global__ void column_sums_kernel(const float* x, float* out, std::int64_t rows,
                                   std::int64_t cols) {
  for (std::int64_t j = blockIdx.x * blockDim.x + threadIdx.x; j < cols;
       j += std::int64_t{gridDim.x} * blockDim.x) {
    float sum = 0.0f;
    for (std::int64_t i = 0; i < rows; ++i) sum += x[i * cols + j];
    out[j] = sum;
  }
}
/// Rounds to fp16 or bf16; raises *flag when a result is inf or NaN.
__global__ void to_half_kernel(const float* x, std::uint16_t* out, std::int64_t n, bool bf16,
                               int* flag) {
  bool bad = false;
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::uint16_t h = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x[i]))
                                 : __half_as_ushort(__float2half_rn(x[i]));
    out[i] = h;
    bad |= bf16 ? (h & 0x7f80) == 0x7f80 : (h & 0x7c00) == 0x7c00;
  }
  if (bad) atomicOr(flag, 1);
}
__global__ void to_float_kernel(const std::uint16_t* h, float* out, std::int64_t n, bool bf16) {
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    out[i] =
        bf16 ? __bfloat162float(__ushort_as_bfloat16(h[i])) : __half2float(__ushort_as_half(h[i]));
}

template <class T>
__global__ void reduce_kernel(T* acc, const T* x, std::size_t n, ReduceOp op) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        acc[i] = static_cast<T>(acc[i] + x[i]);
        break;
      case ReduceOp::max:
        acc[i] = x[i] > acc[i] ? x[i] : acc[i];
        break;
      case ReduceOp::min:
        acc[i] = x[i] < acc[i] ? x[i] : acc[i];
        break;
    }
  }
}
template <class T>
__global__ void divide_kernel(T* acc, std::size_t n, int ranks) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x)
    acc[i] = static_cast<T>(acc[i] / static_cast<T>(ranks));
}

void require_same(const DeviceTensor& a, const DeviceTensor& b, const char* what) {
  require(a.rows() == b.rows() && a.cols() == b.cols(), std::string(what) + ": shapes differ");
}

int device_of(const void* p) {
  cudaPointerAttributes a{};
  CUDA_CHECK(cudaPointerGetAttributes(&a, p));
  return a.type == cudaMemoryTypeDevice ? a.device : -1;
}
}  // namespace

void axpy(float alpha, const DeviceTensor& x, DeviceTensor& y) {
  require_same(x, y, "axpy");
  axpy_kernel<<<blocks(y.size()), threads, 0, cudaStreamPerThread>>>(alpha, x.data(), y.data(),
                                                                     y.size());
  launched();
}

void scale(DeviceTensor& x, float s) {
  scale_kernel<<<blocks(x.size()), threads, 0, cudaStreamPerThread>>>(x.data(), s, x.size());
  launched();
}

DeviceTensor add(const DeviceTensor& a, const DeviceTensor& b) {
  require_same(a, b, "add");
  DeviceTensor out(a.rows(), a.cols());
  add_kernel<<<blocks(a.size()), threads, 0, cudaStreamPerThread>>>(a.data(), b.data(), out.data(),
                                                                    a.size());
  launched();
  return out;
}

DeviceTensor tanh_forward(const DeviceTensor& x) {
  DeviceTensor y(x.rows(), x.cols());
  tanh_kernel<<<blocks(x.size()), threads, 0, cudaStreamPerThread>>>(x.data(), y.data(), x.size());
  launched();
  return y;
}

DeviceTensor tanh_backward(const DeviceTensor& y, const DeviceTensor& dy) {
  require_same(y, dy, "tanh_backward");
  DeviceTensor dx(y.rows(), y.cols());
  tanh_backward_kernel<<<blocks(y.size()), threads, 0, cudaStreamPerThread>>>(y.data(), dy.data(),
                                                                              dx.data(), y.size());
  launched();
  return dx;
}

void adam_step(DeviceTensor& p, const DeviceTensor& g, DeviceTensor& m, DeviceTensor& v, float lr,
               float b1, float b2, float eps, int t) {
  require_same(p, g, "adam_step");
  require_same(p, m, "adam_step");
  require_same(p, v, "adam_step");
  require(t >= 1, "adam_step: t counts from 1");
  const float c1 = 1.0f - std::pow(b1, static_cast<float>(t)),
              c2 = 1.0f - std::pow(b2, static_cast<float>(t));
  adam_kernel<<<blocks(p.size()), threads, 0, cudaStreamPerThread>>>(
      p.data(), g.data(), m.data(), v.data(), lr, b1, b2, eps, c1, c2, p.size());
  launched();
}

DeviceHalves cast_to_half(const DeviceTensor& x, HalfKind kind, bool* nonfinite) {
  DeviceHalves out(static_cast<std::size_t>(x.size()), kind);
  int* flag = nullptr;
  CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
  CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), cudaStreamPerThread));
  if (x.size() > 0)
    to_half_kernel<<<blocks(x.size()), threads, 0, cudaStreamPerThread>>>(
        x.data(), out.data(), x.size(), kind == HalfKind::bf16, flag);
  launched();
  int host_flag = 0;
  copy(&host_flag, flag, sizeof(int));
  cudaFree(flag);
  if (nonfinite) *nonfinite = host_flag != 0;
  return out;
}

DeviceTensor cast_to_float(const DeviceHalves& h) {
  DeviceTensor out(1, static_cast<std::int64_t>(h.size()));
  if (h.size() > 0)
    to_float_kernel<<<blocks(out.size()), threads, 0, cudaStreamPerThread>>>(
        h.data(), out.data(), out.size(), h.kind() == HalfKind::bf16);
  launched();
  return out;
}

float max_abs_diff(const DeviceTensor& a, const DeviceTensor& b) {
  require_same(a, b, "max_abs_diff");
  if (a.size() == 0) return 0.0f;
  const unsigned n_blocks = std::min<unsigned>(blocks(a.size()), 1024);
  DeviceTensor partial(1, n_blocks);
  max_abs_diff_kernel<<<n_blocks, threads, 0, cudaStreamPerThread>>>(a.data(), b.data(),
                                                                     partial.data(), a.size());
  launched();
  const Tensor host = partial.to_host();
  float m = 0.0f;
  for (float v : host) {
    if (std::isnan(v)) return v;
    m = std::max(m, v);
  }
  return m;
}

DeviceTensor matmul(const DeviceTensor& a, const DeviceTensor& b) {
  return matmul(a, b, false, false);
}

DeviceTensor matmul(const DeviceTensor& a, const DeviceTensor& b, bool transpose_a,
                    bool transpose_b) {
  const std::int64_t M = transpose_a ? a.cols() : a.rows(), K = transpose_a ? a.rows() : a.cols();
  const std::int64_t Kb = transpose_b ? b.cols() : b.rows(), N = transpose_b ? b.rows() : b.cols();
  require(K == Kb, "matmul: inner dimensions differ");
  DeviceTensor out(M, N);  // zero-filled: the answer when K is 0
  if (M == 0 || N == 0 || K == 0) return out;
  // One handle per thread (each rank's thread has its own), bound to its stream.
  thread_local cublasHandle_t handle = nullptr;
  thread_local int handle_device = -1;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (!handle || handle_device != device) {
    CUBLAS_CHECK(cublasCreate(&handle));
    CUBLAS_CHECK(cublasSetStream(handle, cudaStreamPerThread));
    handle_device = device;
  }
  // cuBLAS is column-major, and a row-major R x C matrix is, to it, the C x R transpose.
  // So it computes out^T (N x M) = op(b)^T (N x K) @ op(a)^T (K x M): b first, then a; an
  // operand we want untransposed is passed as it lies (OP_N), one we want transposed with
  // OP_T. Leading dimensions are the row-major column counts.
  const float one = 1.0f, zero = 0.0f;
  CUBLAS_CHECK(cublasSgemm(handle, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                           transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
                           static_cast<int>(M), static_cast<int>(K), &one, b.data(),
                           static_cast<int>(b.cols()), a.data(), static_cast<int>(a.cols()), &zero,
                           out.data(), static_cast<int>(N)));
  return out;
}

void add_row(DeviceTensor& y, const DeviceTensor& row) {
  require(row.rows() == 1 && row.cols() == y.cols(), "add_row: the row must be 1 x cols");
  add_row_kernel<<<blocks(y.size()), threads, 0, cudaStreamPerThread>>>(y.data(), row.data(),
                                                                        y.size(), y.cols());
  launched();
}

DeviceTensor column_sums(const DeviceTensor& x) {
  DeviceTensor out(1, x.cols());
  if (x.size() > 0)
    column_sums_kernel<<<blocks(x.cols()), threads, 0, cudaStreamPerThread>>>(x.data(), out.data(),
                                                                              x.rows(), x.cols());
  launched();
  return out;
}

void reduce_into(void* acc, const void* x, std::size_t count, DType type, ReduceOp op) {
  if (count == 0) return;
  const std::size_t bytes = count * dtype_size(type);
  int here = 0;
  CUDA_CHECK(cudaGetDevice(&here));
  // A kernel reads only its own device's memory: bring x over first if it lives elsewhere.
  DeviceTensor staged;
  if (device_of(x) != here) {
    staged =
        DeviceTensor(1, static_cast<std::int64_t>((bytes + sizeof(float) - 1) / sizeof(float)));
    copy(staged.data(), x, bytes);
    x = staged.data();
  }
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    reduce_kernel<T><<<blocks(static_cast<std::int64_t>(count)), threads, 0, cudaStreamPerThread>>>(
        static_cast<T*>(acc), static_cast<const T*>(x), count, op);
  });
  launched();
  synchronize();
}

void finish_reduce(void* acc, std::size_t count, DType type, ReduceOp op, int ranks) {
  if (op != ReduceOp::avg || count == 0) return;
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    divide_kernel<T><<<blocks(static_cast<std::int64_t>(count)), threads, 0, cudaStreamPerThread>>>(
        static_cast<T*>(acc), count, ranks);
  });
  launched();
  synchronize();
}

}  // namespace shardlab::cuda
