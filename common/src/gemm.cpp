// gemm: the host f32 matrix product, plain (the reference) and blocked (the fast ones).
//
// The blocked kernels are one source, gemm_blocked.inc, included here once per instruction
// set under that set's `#pragma GCC target`: AVX2 + FMA (a 6 x 16 tile of c in twelve
// 8-float registers, as BLIS's Haswell kernel) and AVX-512F (12 x 32 in twenty-four
// 16-float registers). The build targets plain x86-64; which kernel runs is decided at run
// time (__builtin_cpu_supports), so one binary is fast on the machine it runs on and still
// runs on one without AVX2. The library's -ffp-contract=off keeps the compiler from fusing
// anything itself: every fused multiply-add here is written as one.
#include "gemm.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "shardlab/check.hpp"
#include "shardlab/tensor.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SHARDLAB_GEMM_X86 1
#include <immintrin.h>
#endif

namespace shardlab::gemm {

// ---------------------------------------------------------------------------
// The reference

namespace {

// The loops, written once; the two copies below differ only in the instructions the
// compiler may use (one fused multiply-add is one rounding on every CPU, in hardware or in
// libm's fmaf).
inline void reference_loops(const float* a, const float* b, float* c, std::int64_t M,
                            std::int64_t N, std::int64_t K, bool transpose_a, bool transpose_b) {
  if (transpose_b) {
    // out(i, j) = op(a)'s row i . b's row j: b contiguous in k.
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) {
        float sum = 0.0f;
        for (std::int64_t k = 0; k < K; ++k)
          sum = __builtin_fmaf(transpose_a ? a[k * M + i] : a[i * K + k], b[j * K + k], sum);
        c[i * N + j] = sum;
      }
    return;
  }
  // i-k-j order: the inner loop walks rows of b and out contiguously (it vectorises), and
  // out(i, j) still accumulates over k = 0..K-1 in order.
  std::fill(c, c + M * N, 0.0f);
  for (std::int64_t i = 0; i < M; ++i) {
    float* out_row = c + i * N;
    for (std::int64_t k = 0; k < K; ++k) {
      const float aik = transpose_a ? a[k * M + i] : a[i * K + k];
      const float* b_row = b + k * N;
      for (std::int64_t j = 0; j < N; ++j) out_row[j] = __builtin_fmaf(aik, b_row[j], out_row[j]);
    }
  }
}

#ifdef SHARDLAB_GEMM_X86
__attribute__((target("avx2,fma"))) void reference_fma(const float* a, const float* b, float* c,
                                                       std::int64_t M, std::int64_t N,
                                                       std::int64_t K, bool ta, bool tb) {
  reference_loops(a, b, c, M, N, K, ta, tb);
}
#endif

}  // namespace

void host_matmul_reference_f32(const float* a, const float* b, float* c, std::int64_t M,
                               std::int64_t N, std::int64_t K, bool transpose_a, bool transpose_b) {
#ifdef SHARDLAB_GEMM_X86
  if (kernel_available(Kernel::avx2))
    return reference_fma(a, b, c, M, N, K, transpose_a, transpose_b);
#endif
  reference_loops(a, b, c, M, N, K, transpose_a, transpose_b);
}

// ---------------------------------------------------------------------------
// The blocked kernels

#ifdef SHARDLAB_GEMM_X86

namespace {

/// A packing buffer of the calling thread, 64-byte aligned, grown on demand.
class PackBuffer {
 public:
  float* get(std::int64_t count) {
    const auto n = static_cast<std::size_t>(count);
    if (n > size_) {
      data_.reset(static_cast<float*>(::operator new (n * sizeof(float), std::align_val_t{64})));
      size_ = n;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { ::operator delete (p, std::align_val_t{64}); }
  };
  std::unique_ptr<float, Free> data_;
  std::size_t size_ = 0;
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace {
namespace avx2 {
struct Vec {
  using type = __m256;
  static constexpr int width = 8;
  static type zero() { return _mm256_setzero_ps(); }
  static type load(const float* p) { return _mm256_load_ps(p); }
  static type loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, type v) { _mm256_storeu_ps(p, v); }
  static type broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static type fma(type x, type y, type acc) { return _mm256_fmadd_ps(x, y, acc); }
};
constexpr std::int64_t MR = 6, NR = 16, KC = 384, MC = 96, NC = 2048;
#include "gemm_blocked.inc"
}  // namespace avx2

// The avx512 kernel's shape in AVX2 registers, for the tests (see gemm.hpp).
namespace avx512_shape {
using Vec = avx2::Vec;
constexpr std::int64_t MR = 12, NR = 32, KC = 192, MC = 144, NC = 2048;
#include "gemm_blocked.inc"
}  // namespace avx512_shape
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace {
namespace avx512 {
struct Vec {
  using type = __m512;
  static constexpr int width = 16;
  static type zero() { return _mm512_setzero_ps(); }
  static type load(const float* p) { return _mm512_load_ps(p); }
  static type loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, type v) { _mm512_storeu_ps(p, v); }
  static type broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static type fma(type x, type y, type acc) { return _mm512_fmadd_ps(x, y, acc); }
};
using avx512_shape::MR, avx512_shape::NR, avx512_shape::KC, avx512_shape::MC, avx512_shape::NC;
#include "gemm_blocked.inc"
}  // namespace avx512
}  // namespace
#pragma GCC pop_options

#endif  // SHARDLAB_GEMM_X86

// ---------------------------------------------------------------------------
// Choosing one

const char* kernel_name(Kernel kernel) {
  switch (kernel) {
    case Kernel::avx2:
      return "avx2";
    case Kernel::avx512:
      return "avx512";
    case Kernel::reference:
      break;
  }
  return "reference";
}

bool kernel_available(Kernel kernel) {
#ifdef SHARDLAB_GEMM_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
  if (kernel == Kernel::avx2) return avx2;
  if (kernel == Kernel::avx512) return avx512;
#else
  if (kernel != Kernel::reference) return false;
#endif
  return true;
}

namespace {
Kernel choose_kernel() {
  const char* forced = std::getenv("SHARDLAB_GEMM");
  if (forced == nullptr || *forced == '\0') {
    for (Kernel k : {Kernel::avx512, Kernel::avx2})
      if (kernel_available(k)) return k;
    return Kernel::reference;
  }
  for (Kernel k : {Kernel::reference, Kernel::avx2, Kernel::avx512})
    if (std::string(forced) == kernel_name(k)) {
      if (!kernel_available(k))
        throw UsageError("SHARDLAB_GEMM=" + std::string(forced) + ": this CPU cannot run the " +
                         forced + " kernel (unset it, or pick reference" +
                         (kernel_available(Kernel::avx2) ? " or avx2)" : ")"));
      return k;
    }
  throw UsageError("SHARDLAB_GEMM='" + std::string(forced) +
                   "' names no GEMM kernel (reference, avx2 or avx512)");
}
}  // namespace

Kernel kernel_in_use() {
  static const Kernel chosen = choose_kernel();  // a throw leaves it unset: asked again
  return chosen;
}

Blocking kernel_blocking(Kernel kernel) {
#ifdef SHARDLAB_GEMM_X86
  if (kernel == Kernel::avx2) return {avx2::MR, avx2::NR, avx2::KC, avx2::MC, avx2::NC};
  if (kernel == Kernel::avx512) return {avx512::MR, avx512::NR, avx512::KC, avx512::MC, avx512::NC};
#else
  (void)kernel;
#endif
  return {};
}

void host_matmul_kernel_f32(Kernel kernel, const float* a, const float* b, float* c, std::int64_t M,
                            std::int64_t N, std::int64_t K, bool transpose_a, bool transpose_b) {
  require(kernel_available(kernel), [&] {
    return std::string("gemm: this CPU cannot run the ") + kernel_name(kernel) + " kernel";
  });
#ifdef SHARDLAB_GEMM_X86
  if (kernel == Kernel::avx2) return avx2::blocked(a, b, c, M, N, K, transpose_a, transpose_b);
  if (kernel == Kernel::avx512) return avx512::blocked(a, b, c, M, N, K, transpose_a, transpose_b);
#endif
  host_matmul_reference_f32(a, b, c, M, N, K, transpose_a, transpose_b);
}

void host_matmul_fast_f32(const float* a, const float* b, float* c, std::int64_t M, std::int64_t N,
                          std::int64_t K, bool transpose_a, bool transpose_b) {
  host_matmul_kernel_f32(kernel_in_use(), a, b, c, M, N, K, transpose_a, transpose_b);
}

void host_matmul_avx512_shape_on_avx2_f32(const float* a, const float* b, float* c, std::int64_t M,
                                          std::int64_t N, std::int64_t K, bool transpose_a,
                                          bool transpose_b) {
  require(kernel_available(Kernel::avx2), "gemm: the avx512 shape's test runs on AVX2");
#ifdef SHARDLAB_GEMM_X86
  avx512_shape::blocked(a, b, c, M, N, K, transpose_a, transpose_b);
#else
  (void)a, (void)b, (void)c, (void)M, (void)N, (void)K, (void)transpose_a, (void)transpose_b;
#endif
}

}  // namespace shardlab::gemm

namespace shardlab {

void matmul_reference_into(Tensor& out, const Tensor& a, const Tensor& b, bool transpose_a,
                           bool transpose_b) {
  require(a.ndim() == 2 && b.ndim() == 2 && out.ndim() == 2, [&] {
    return "matmul_reference: needs 2-D tensors, got " + a.describe() + " and " + b.describe();
  });
  require(a.dtype() == DType::f32 && b.dtype() == DType::f32 && out.dtype() == DType::f32 &&
              !a.on_device() && !b.on_device() && !out.on_device(),
          [&] {
            return "matmul_reference: needs f32 host tensors, got " + a.describe() + " and " +
                   b.describe();
          });
  const std::int64_t M = transpose_a ? a.cols() : a.rows(), K = transpose_a ? a.rows() : a.cols();
  const std::int64_t Kb = transpose_b ? b.cols() : b.rows(), N = transpose_b ? b.rows() : b.cols();
  require(K == Kb && out.rows() == M && out.cols() == N, [&] {
    return "matmul_reference: " + a.shape_string() + (transpose_a ? "^T" : "") + " @ " +
           b.shape_string() + (transpose_b ? "^T" : "") + " into " + out.shape_string();
  });
  gemm::host_matmul_reference_f32(a.data(), b.data(), out.data(), M, N, K, transpose_a,
                                  transpose_b);
}

const char* host_matmul_kernel() { return gemm::kernel_name(gemm::kernel_in_use()); }

Tensor matmul_reference(const Tensor& a, const Tensor& b, bool transpose_a, bool transpose_b) {
  require(a.ndim() == 2 && b.ndim() == 2, [&] {
    return "matmul_reference: needs 2-D tensors, got " + a.describe() + " and " + b.describe();
  });
  Tensor out = empty(Shape{transpose_a ? a.cols() : a.rows(), transpose_b ? b.rows() : b.cols()});
  matmul_reference_into(out, a, b, transpose_a, transpose_b);
  return out;
}

}  // namespace shardlab
