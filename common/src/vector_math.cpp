// vector_math: see vector_math.hpp. The loops are one source, vector_math.inc, included
// twice: with one float per lane (any CPU), and with AVX2's eight under its target pragma
// (chosen at run time, as gemm.cpp chooses its kernel). -ffp-contract=off keeps the
// compiler from fusing what the source does not fuse.
#include "vector_math.hpp"

#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SHARDLAB_VMATH_X86 1
#include <immintrin.h>
#endif

namespace shardlab::vmath {

namespace {

/// One float: the operations of the lane types, each one IEEE operation.
struct Scalar {
  using type = float;
  static constexpr int width = 1;
  static float set(float v) { return v; }
  static float add(float a, float b) { return a + b; }
  static float sub(float a, float b) { return a - b; }
  static float mul(float a, float b) { return a * b; }
  static float div(float a, float b) { return a / b; }
  static float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
  // min and max as the vector instructions do them: the second operand when either is NaN.
  static float min(float a, float b) { return a < b ? a : b; }
  static float max(float a, float b) { return a > b ? a : b; }
  static float round(float a) { return __builtin_nearbyintf(a); }  // to nearest, ties even
  static float pow2(float n) {  // 2^n for integral n in -126..127
    return std::bit_cast<float>(static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127)
                                << 23);
  }
  static bool greater(float a, float b) { return a > b; }
  static bool less(float a, float b) { return a < b; }
  static bool is_nan(float a) { return a != a; }
  static float select(bool m, float a, float b) { return m ? a : b; }
  static float load(const float* p) { return *p; }
  static void store(float* p, float v) { *p = v; }
};

namespace portable {
using Wide = Scalar;
using One = Scalar;
#include "vector_math.inc"
}  // namespace portable

}  // namespace

#ifdef SHARDLAB_VMATH_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace {
namespace avx2 {
/// Eight floats; the same operations as Scalar's, lane by lane.
struct Wide {
  using type = __m256;
  static constexpr int width = 8;
  static type set(float v) { return _mm256_set1_ps(v); }
  static type add(type a, type b) { return _mm256_add_ps(a, b); }
  static type sub(type a, type b) { return _mm256_sub_ps(a, b); }
  static type mul(type a, type b) { return _mm256_mul_ps(a, b); }
  static type div(type a, type b) { return _mm256_div_ps(a, b); }
  static type fma(type a, type b, type c) { return _mm256_fmadd_ps(a, b, c); }
  static type min(type a, type b) { return _mm256_min_ps(a, b); }
  static type max(type a, type b) { return _mm256_max_ps(a, b); }
  static type round(type a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static type pow2(type n) {
    const __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(bits);
  }
  static type greater(type a, type b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static type less(type a, type b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static type is_nan(type a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
  static type select(type m, type a, type b) { return _mm256_blendv_ps(b, a, m); }
  static type load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, type v) { _mm256_storeu_ps(p, v); }
};
using One = Scalar;
#include "vector_math.inc"
}  // namespace avx2
}  // namespace
#pragma GCC pop_options

namespace {
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
}  // namespace
#define SHARDLAB_VMATH_DISPATCH(call) \
  if (has_avx2()) return avx2::call;  \
  return portable::call
#else
#define SHARDLAB_VMATH_DISPATCH(call) return portable::call
#endif

float exp(float x) { return portable::exp_of<Scalar>(x); }

SHARDLAB_VECTOR_CLONES double sum_of_squares(const float* x, std::int64_t n) {
  return lane_sum(n, [x](std::int64_t i) { return static_cast<double>(x[i]) * x[i]; });
}

void exp(const float* x, float shift, float* y, std::int64_t n) {
  SHARDLAB_VMATH_DISPATCH(exp_loop(x, shift, y, n));
}

void gelu(const float* x, float* y, std::int64_t n) { SHARDLAB_VMATH_DISPATCH(gelu_loop(x, y, n)); }

void gelu_backward(const float* x, const float* dy, float* dx, std::int64_t n) {
  SHARDLAB_VMATH_DISPATCH(gelu_grad_loop(x, dy, dx, n));
}

}  // namespace shardlab::vmath
