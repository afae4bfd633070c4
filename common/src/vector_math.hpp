// vector_math: the host's elementwise transcendental loops (exp, GELU and its gradient),
// vectorised where the CPU has AVX2 + FMA, with the same bits everywhere: every element
// is one fixed sequence of single-precision operations (vector_math.inc), whichever lanes
// compute it, so an element does not depend on the CPU, on the array's length or on where
// a shard starts. And the sums the layers take in double, in eight running sums whose
// order is fixed (lane_sum), so that they too give the same bits on every CPU.
#pragma once

#include <cstdint>

/// A loop compiled three times, for AVX-512, for AVX2 and for any x86-64, the CPU's own
/// chosen when the program loads (GCC's target_clones). The library builds without
/// -ffp-contract and without math's errno, so each copy's vectors do an element's
/// operations exactly as the plain loop does: the same bits, only more lanes at once.
/// Not under ThreadSanitizer: a clone's resolver runs while the loader relocates the
/// program, before TSan's runtime is set up, and the instrumented resolver crashed every
/// program of that build before main.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define SHARDLAB_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SHARDLAB_VECTOR_CLONES
#endif

namespace shardlab::vmath {

/// The sum of term(0) .. term(n-1) in double, as eight running sums: term j goes to sum
/// j mod 8 (n / 8 * 8 of them), the eight are added pairwise, ((s0 + s4) + (s1 + s5)) +
/// ((s2 + s6) + (s3 + s7)), then the last n mod 8 terms in order. The order is the
/// definition, not the CPU's: a compiler vectorises the eight sums lane by lane (in a
/// SHARDLAB_VECTOR_CLONES function) and gets the same bits as the scalar loop.
template <class Term>
inline double lane_sum(std::int64_t n, Term term) {
  double s[8] = {};
  std::int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) s[l] += term(j + l);
  double sum = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
  for (; j < n; ++j) sum += term(j);
  return sum;
}

/// The sum of x[i]^2 (each square in double), i < n, in lane_sum's order.
double sum_of_squares(const float* x, std::int64_t n);

/// e^x for one float: the same bits as exp() gives each element.
float exp(float x);

/// y[i] = e^(x[i] - shift), i < n (x and y may be the same array).
void exp(const float* x, float shift, float* y, std::int64_t n);

/// y[i] = GELU(x[i]), the tanh form (GPT-2's gelu_new) as x sigmoid(2u).
void gelu(const float* x, float* y, std::int64_t n);

/// dx[i] = GELU'(x[i]) dy[i].
void gelu_backward(const float* x, const float* dy, float* dx, std::int64_t n);

}  // namespace shardlab::vmath
