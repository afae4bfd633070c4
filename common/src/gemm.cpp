// gemm: the host f32 matrix product, plain (the reference) and blocked (the fast one).
//
// The blocked kernel is the classic GotoBLAS / BLIS layout: for a block of NC columns and
// KC values of k, op(b) is packed into 16-column panels (k-major, so one k's 16 values are
// adjacent); for a block of MC rows, op(a) is packed into 6-row panels; a micro-kernel
// multiplies one 6-row panel by one 16-column panel, keeping the 6 x 16 elements of c in
// twelve AVX2 registers while it walks k in ascending order. Transposed operands are read
// through the packing only, so the micro-kernel sees the same numbers in the same order
// whichever operand is transposed.
//
// Why the result is the reference's bit for bit: each element of c is one lane of one
// accumulator, which starts at +0.0f (first k block) or at the partial sum the previous k
// block stored in c (later ones), then adds _mm256_mul_ps(a, b), rounded, for each k in
// order: exactly the reference's `sum += a * b`. The multiply and the add stay two
// instructions because this file is compiled without FMA (target "avx2" alone, and the
// library's -ffp-contract=off). Edge tiles run the same micro-kernel on a 6 x 16 copy of
// the tile (zero padding in the packed panels, whose lanes are thrown away), so an
// element's arithmetic does not depend on where the tile edges fall.
#include "gemm.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <new>

#include "shardlab/check.hpp"
#include "shardlab/tensor.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHARDLAB_GEMM_AVX2 1
#include <immintrin.h>
#endif

namespace shardlab::gemm {

void host_matmul_reference_f32(const float* a, const float* b, float* c, std::int64_t M,
                               std::int64_t N, std::int64_t K, bool transpose_a, bool transpose_b) {
  if (transpose_a && transpose_b) {
    // out(i, j) = column i of a . row j of b.
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) {
        float sum = 0.0f;
        for (std::int64_t k = 0; k < K; ++k) sum += a[k * M + i] * b[j * K + k];
        c[i * N + j] = sum;
      }
    return;
  }
  std::fill(c, c + M * N, 0.0f);
  if (transpose_b) {
    // out(i, j) = a's row i . b's row j: both contiguous in k.
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) {
        float sum = 0.0f;
        for (std::int64_t k = 0; k < K; ++k) sum += a[i * K + k] * b[j * K + k];
        c[i * N + j] = sum;
      }
    return;
  }
  if (transpose_a) {
    // k-i-j: row k of a holds column k of a^T; the inner loop walks rows of b and out.
    for (std::int64_t k = 0; k < K; ++k)
      for (std::int64_t i = 0; i < M; ++i) {
        const float aki = a[k * M + i];
        float* out_row = c + i * N;
        const float* b_row = b + k * N;
        for (std::int64_t j = 0; j < N; ++j) out_row[j] += aki * b_row[j];
      }
    return;
  }
  // i-k-j order: the inner loop walks rows of b and out contiguously (cache friendly,
  // vectorises), and out(i, j) still accumulates over k = 0..K-1 in order.
  for (std::int64_t i = 0; i < M; ++i) {
    float* out_row = c + i * N;
    for (std::int64_t k = 0; k < K; ++k) {
      const float aik = a[i * K + k];
      const float* b_row = b + k * N;
      for (std::int64_t j = 0; j < N; ++j) out_row[j] += aik * b_row[j];
    }
  }
}

#ifdef SHARDLAB_GEMM_AVX2

namespace {

constexpr std::int64_t MR = blocked_tile_rows, NR = blocked_tile_cols;
constexpr std::int64_t KC = blocked_k_block, MC = blocked_row_block, NC = blocked_col_block;

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

/// Rows i0 .. i0+mc-1 and k = p0 .. p0+kc-1 of op(a) into 6-row panels: panel r holds,
/// for each k, the 6 values op(a)(i0 + 6r + 0..5, k); rows past mc are zero.
void pack_a(float* dst, const float* a, std::int64_t M, std::int64_t K, bool transpose_a,
            std::int64_t i0, std::int64_t mc, std::int64_t p0, std::int64_t kc) {
  for (std::int64_t ir = 0; ir < mc; ir += MR, dst += MR * kc) {
    const std::int64_t mr = std::min(MR, mc - ir);
    if (mr < MR) std::fill(dst, dst + MR * kc, 0.0f);
    if (transpose_a) {
      for (std::int64_t k = 0; k < kc; ++k) {
        const float* src = a + (p0 + k) * M + i0 + ir;
        for (std::int64_t r = 0; r < mr; ++r) dst[k * MR + r] = src[r];
      }
    } else {
      for (std::int64_t r = 0; r < mr; ++r) {
        const float* src = a + (i0 + ir + r) * K + p0;
        for (std::int64_t k = 0; k < kc; ++k) dst[k * MR + r] = src[k];
      }
    }
  }
}

/// k = p0 .. p0+kc-1 and columns j0 .. j0+nc-1 of op(b) into 16-column panels: panel q
/// holds, for each k, the 16 values op(b)(k, j0 + 16q + 0..15); columns past nc are zero.
void pack_b(float* dst, const float* b, std::int64_t N, std::int64_t K, bool transpose_b,
            std::int64_t j0, std::int64_t nc, std::int64_t p0, std::int64_t kc) {
  for (std::int64_t jr = 0; jr < nc; jr += NR, dst += NR * kc) {
    const std::int64_t nr = std::min(NR, nc - jr);
    if (nr < NR) std::fill(dst, dst + NR * kc, 0.0f);
    if (transpose_b) {
      for (std::int64_t col = 0; col < nr; ++col) {
        const float* src = b + (j0 + jr + col) * K + p0;
        for (std::int64_t k = 0; k < kc; ++k) dst[k * NR + col] = src[k];
      }
    } else {
      for (std::int64_t k = 0; k < kc; ++k)
        std::memcpy(dst + k * NR, b + (p0 + k) * N + j0 + jr,
                    static_cast<std::size_t>(nr) * sizeof(float));
    }
  }
}

/// c (6 x 16, row stride ldc) = (first ? +0 : c) + sum over k of ap[k] (x) bp[k], each
/// lane adding its products one k at a time, in order. ap: kc x 6, bp: kc x 16 (packed).
__attribute__((target("avx2"))) void micro_kernel(std::int64_t kc, const float* __restrict ap,
                                                  const float* __restrict bp, float* c,
                                                  std::int64_t ldc, bool first) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  if (first) {
    c00 = c01 = c10 = c11 = c20 = c21 = _mm256_setzero_ps();
    c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
  } else {
    c00 = _mm256_loadu_ps(c + 0 * ldc), c01 = _mm256_loadu_ps(c + 0 * ldc + 8);
    c10 = _mm256_loadu_ps(c + 1 * ldc), c11 = _mm256_loadu_ps(c + 1 * ldc + 8);
    c20 = _mm256_loadu_ps(c + 2 * ldc), c21 = _mm256_loadu_ps(c + 2 * ldc + 8);
    c30 = _mm256_loadu_ps(c + 3 * ldc), c31 = _mm256_loadu_ps(c + 3 * ldc + 8);
    c40 = _mm256_loadu_ps(c + 4 * ldc), c41 = _mm256_loadu_ps(c + 4 * ldc + 8);
    c50 = _mm256_loadu_ps(c + 5 * ldc), c51 = _mm256_loadu_ps(c + 5 * ldc + 8);
  }
#pragma GCC unroll 4
  for (std::int64_t k = 0; k < kc; ++k, ap += MR, bp += NR) {
    const __m256 b0 = _mm256_load_ps(bp), b1 = _mm256_load_ps(bp + 8);
    __m256 x = _mm256_broadcast_ss(ap + 0);
    c00 = _mm256_add_ps(c00, _mm256_mul_ps(x, b0));
    c01 = _mm256_add_ps(c01, _mm256_mul_ps(x, b1));
    x = _mm256_broadcast_ss(ap + 1);
    c10 = _mm256_add_ps(c10, _mm256_mul_ps(x, b0));
    c11 = _mm256_add_ps(c11, _mm256_mul_ps(x, b1));
    x = _mm256_broadcast_ss(ap + 2);
    c20 = _mm256_add_ps(c20, _mm256_mul_ps(x, b0));
    c21 = _mm256_add_ps(c21, _mm256_mul_ps(x, b1));
    x = _mm256_broadcast_ss(ap + 3);
    c30 = _mm256_add_ps(c30, _mm256_mul_ps(x, b0));
    c31 = _mm256_add_ps(c31, _mm256_mul_ps(x, b1));
    x = _mm256_broadcast_ss(ap + 4);
    c40 = _mm256_add_ps(c40, _mm256_mul_ps(x, b0));
    c41 = _mm256_add_ps(c41, _mm256_mul_ps(x, b1));
    x = _mm256_broadcast_ss(ap + 5);
    c50 = _mm256_add_ps(c50, _mm256_mul_ps(x, b0));
    c51 = _mm256_add_ps(c51, _mm256_mul_ps(x, b1));
  }
  _mm256_storeu_ps(c + 0 * ldc, c00), _mm256_storeu_ps(c + 0 * ldc + 8, c01);
  _mm256_storeu_ps(c + 1 * ldc, c10), _mm256_storeu_ps(c + 1 * ldc + 8, c11);
  _mm256_storeu_ps(c + 2 * ldc, c20), _mm256_storeu_ps(c + 2 * ldc + 8, c21);
  _mm256_storeu_ps(c + 3 * ldc, c30), _mm256_storeu_ps(c + 3 * ldc + 8, c31);
  _mm256_storeu_ps(c + 4 * ldc, c40), _mm256_storeu_ps(c + 4 * ldc + 8, c41);
  _mm256_storeu_ps(c + 5 * ldc, c50), _mm256_storeu_ps(c + 5 * ldc + 8, c51);
}

/// A tile of c, mr x nr <= 6 x 16, through the micro-kernel: in place when full, else
/// through a 6 x 16 copy (the same arithmetic, only mr x nr of it kept).
__attribute__((target("avx2"))) void tile(std::int64_t kc, const float* ap, const float* bp,
                                          float* c, std::int64_t ldc, std::int64_t mr,
                                          std::int64_t nr, bool first) {
  if (mr == MR && nr == NR) return micro_kernel(kc, ap, bp, c, ldc, first);
  alignas(32) float t[MR * NR] = {};
  const auto row_bytes = static_cast<std::size_t>(nr) * sizeof(float);
  if (!first)
    for (std::int64_t r = 0; r < mr; ++r) std::memcpy(t + r * NR, c + r * ldc, row_bytes);
  micro_kernel(kc, ap, bp, t, NR, first);
  for (std::int64_t r = 0; r < mr; ++r) std::memcpy(c + r * ldc, t + r * NR, row_bytes);
}

/// Asks the cache for rows x cols of c at p: the tile after this one, whose partial sums
/// (after the first k block) are loaded first thing, arrives while this one computes.
void prefetch(const float* p, std::int64_t ldc, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(p + r * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + r * ldc + cols - 1), _MM_HINT_T0);
  }
}

}  // namespace

bool host_matmul_blocked_available() {
  static const bool available = __builtin_cpu_supports("avx2");
  return available;
}

void host_matmul_blocked_f32(const float* a, const float* b, float* c, std::int64_t M,
                             std::int64_t N, std::int64_t K, bool transpose_a, bool transpose_b) {
  if (M == 0 || N == 0) return;
  if (K == 0) return std::fill(c, c + M * N, 0.0f);
  thread_local PackBuffer a_buffer, b_buffer;
  const std::int64_t kc_max = std::min(KC, K);
  const std::int64_t mc_max = std::min(MC, (M + MR - 1) / MR * MR);
  const std::int64_t nc_max = std::min(NC, (N + NR - 1) / NR * NR);
  float* const pa = a_buffer.get(mc_max * kc_max);
  float* const pb = b_buffer.get(nc_max * kc_max);
  for (std::int64_t jc = 0; jc < N; jc += NC) {
    const std::int64_t nc = std::min(NC, N - jc);
    for (std::int64_t pc = 0; pc < K; pc += KC) {
      const std::int64_t kc = std::min(KC, K - pc);
      pack_b(pb, b, N, K, transpose_b, jc, nc, pc, kc);
      for (std::int64_t ic = 0; ic < M; ic += MC) {
        const std::int64_t mc = std::min(MC, M - ic);
        pack_a(pa, a, M, K, transpose_a, ic, mc, pc, kc);
        for (std::int64_t jr = 0; jr < nc; jr += NR)
          for (std::int64_t ir = 0; ir < mc; ir += MR) {
            float* const here = c + (ic + ir) * N + jc + jr;
            if (ir + MR < mc)  // the tile below, or the first of the next column
              prefetch(here + MR * N, N, std::min(MR, mc - ir - MR), std::min(NR, nc - jr));
            else if (jr + NR < nc)
              prefetch(c + ic * N + jc + jr + NR, N, std::min(MR, mc), std::min(NR, nc - jr - NR));
            tile(kc, pa + ir * kc, pb + jr * kc, here, N, std::min(MR, mc - ir),
                 std::min(NR, nc - jr), pc == 0);
          }
      }
    }
  }
}

#else  // no AVX2 kernel for this target: the reference stands in

bool host_matmul_blocked_available() { return false; }

void host_matmul_blocked_f32(const float* a, const float* b, float* c, std::int64_t M,
                             std::int64_t N, std::int64_t K, bool transpose_a, bool transpose_b) {
  host_matmul_reference_f32(a, b, c, M, N, K, transpose_a, transpose_b);
}

#endif

void host_matmul_fast_f32(const float* a, const float* b, float* c, std::int64_t M, std::int64_t N,
                          std::int64_t K, bool transpose_a, bool transpose_b) {
  if (host_matmul_blocked_available())
    host_matmul_blocked_f32(a, b, c, M, N, K, transpose_a, transpose_b);
  else
    host_matmul_reference_f32(a, b, c, M, N, K, transpose_a, transpose_b);
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

Tensor matmul_reference(const Tensor& a, const Tensor& b, bool transpose_a, bool transpose_b) {
  require(a.ndim() == 2 && b.ndim() == 2, [&] {
    return "matmul_reference: needs 2-D tensors, got " + a.describe() + " and " + b.describe();
  });
  Tensor out = empty(Shape{transpose_a ? a.cols() : a.rows(), transpose_b ? b.rows() : b.cols()});
  matmul_reference_into(out, a, b, transpose_a, transpose_b);
  return out;
}

}  // namespace shardlab
