// cuda: what the library asks of CUDA — devices, device memory, the few kernels the
// chapters need, and cuBLAS's matmul. It builds without CUDA too: then there is never a
// device, and anything that needs one throws UsageError with a clear message.
//
// Every kernel here has a CPU reference in tensor.hpp / nn.hpp, and test_cuda.cpp checks
// each against it on random data before anything is timed (llm.c's pattern). Errors go
// through one check function: CUDA_CHECK(call), CUBLAS_CHECK(call) name the call, the
// file and the line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace shardlab::cuda {

// ---------------------------------------------------------------------------
// Devices

/// True when this build has CUDA (nvcc was found at configure time).
bool built();
/// Number of usable CUDA devices: 0 without a CUDA build, a driver or a GPU.
int device_count();
/// "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79 GiB" for device `index`, or why there is none.
std::string describe_device(int index);
/// Peak FP32 throughput from the device's properties: SMs x FP32 lanes per SM x clock x 2
/// (an FMA is two flops). 0 when the architecture's lanes per SM are not in the table.
double peak_fp32_tflops(int index);
/// Makes `index` the current device of the calling thread (each rank's thread calls it).
void set_device(int index);
/// The device rank `rank` uses: ranks map to GPUs round robin.
int device_for_rank(int rank);

// ---------------------------------------------------------------------------
// Device memory

/// A float tensor in device memory (plain cudaMalloc: no managed memory), row-major,
/// rows x cols. Moves, does not copy; to_device / to_host copy explicitly.
class DeviceTensor {
 public:
  static constexpr Memory memory = Memory::device;  // the communicator reads this
  DeviceTensor() = default;
  DeviceTensor(std::int64_t rows, std::int64_t cols);  // zero-filled
  ~DeviceTensor();
  DeviceTensor(DeviceTensor&& o) noexcept;
  DeviceTensor& operator=(DeviceTensor&& o) noexcept;
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;

  static DeviceTensor to_device(const Tensor& host);
  Tensor to_host() const;

  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  std::int64_t size() const { return rows_ * cols_; }
  float* data() const { return data_; }
  float* begin() const { return data_; }
  float* end() const { return data_ + size(); }

 private:
  float* data_ = nullptr;
  std::int64_t rows_ = 0, cols_ = 0;
};

/// fp16 or bf16 values in device memory, held as their 16-bit encodings (half.hpp).
enum class HalfKind { fp16, bf16 };
class DeviceHalves {
 public:
  DeviceHalves() = default;
  DeviceHalves(std::size_t count, HalfKind kind);
  ~DeviceHalves();
  DeviceHalves(DeviceHalves&& o) noexcept;
  DeviceHalves& operator=(DeviceHalves&& o) noexcept;
  DeviceHalves(const DeviceHalves&) = delete;
  DeviceHalves& operator=(const DeviceHalves&) = delete;
  std::size_t size() const { return count_; }
  HalfKind kind() const { return kind_; }
  std::uint16_t* data() const { return data_; }
  std::vector<std::uint16_t> to_host() const;

 private:
  std::uint16_t* data_ = nullptr;
  std::size_t count_ = 0;
  HalfKind kind_ = HalfKind::fp16;
};

/// cudaMemcpy with cudaMemcpyDefault: host or device, either way, any device.
void copy(void* dst, const void* src, std::size_t bytes);

// ---------------------------------------------------------------------------
// Kernels (each next to its CPU reference: tensor.hpp, nn.hpp)

/// out = a @ b through cuBLAS (FP32). Row-major a (M x K) and b (K x N) are, to
/// column-major cuBLAS, a^T and b^T; it computes out^T = b^T a^T, which in row-major is
/// exactly out = a @ b, by swapping the operands: no transposes are materialised.
DeviceTensor matmul(const DeviceTensor& a, const DeviceTensor& b);
/// out = op(a) @ op(b), op transposing where asked: a^T @ b (x^T dy) or a @ b^T (dy W^T),
/// through cuBLAS's transpose flags (nothing is materialised).
DeviceTensor matmul(const DeviceTensor& a, const DeviceTensor& b, bool transpose_a,
                    bool transpose_b);
/// y(i, j) += row(0, j) for every row i: a bias (CPU reference: nn::Linear::forward).
void add_row(DeviceTensor& y, const DeviceTensor& row);
/// out(0, j) = sum over i of x(i, j), summed in order i = 0, 1, ... (CPU reference: the
/// bias gradient in nn::Linear::backward).
DeviceTensor column_sums(const DeviceTensor& x);
/// y += alpha * x.
void axpy(float alpha, const DeviceTensor& x, DeviceTensor& y);
/// x *= s.
void scale(DeviceTensor& x, float s);
/// out = a + b.
DeviceTensor add(const DeviceTensor& a, const DeviceTensor& b);
/// y = tanh(x), and dx = dy * (1 - y^2).
DeviceTensor tanh_forward(const DeviceTensor& x);
DeviceTensor tanh_backward(const DeviceTensor& y, const DeviceTensor& dy);
/// One Adam step (Kingma & Ba 2015, Algorithm 1) on every element, t counting from 1:
/// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) +
/// eps).
void adam_step(DeviceTensor& p, const DeviceTensor& g, DeviceTensor& m, DeviceTensor& v, float lr,
               float b1, float b2, float eps, int t);
/// Rounds x to fp16 or bf16 (nearest even: __float2half_rn / __float2bfloat16_rn; the CPU
/// reference is half.hpp) and sets *nonfinite when any result is inf or NaN — the
/// overflow a loss-scaled gradient must be checked for (chapter 06).
DeviceHalves cast_to_half(const DeviceTensor& x, HalfKind kind, bool* nonfinite);
/// The exact float32 values of fp16 or bf16 encodings, as a 1 x n tensor.
DeviceTensor cast_to_float(const DeviceHalves& h);

/// max |a - b| over all elements, computed on the device.
float max_abs_diff(const DeviceTensor& a, const DeviceTensor& b);

/// For the threads backend's reductions over device buffers: acc = op(acc, x), count
/// elements of `type` (x may live on another device), and avg's division by `ranks`.
void reduce_into(void* acc, const void* x, std::size_t count, DType type, ReduceOp op);
void finish_reduce(void* acc, std::size_t count, DType type, ReduceOp op, int ranks);

/// Waits for the calling thread's device to finish its work.
void synchronize();

}  // namespace shardlab::cuda
