// vector_math: the host's elementwise transcendental loops (exp, GELU and its gradient),
// vectorised where the CPU has AVX2 + FMA, with the same bits everywhere: every element
// is one fixed sequence of single-precision operations (vector_math.inc), whichever lanes
// compute it, so an element does not depend on the CPU, on the array's length or on where
// a shard starts.
#pragma once

#include <cstdint>

namespace shardlab::vmath {

/// e^x for one float: the same bits as exp() gives each element.
float exp(float x);

/// y[i] = e^(x[i] - shift), i < n (x and y may be the same array).
void exp(const float* x, float shift, float* y, std::int64_t n);

/// y[i] = GELU(x[i]), the tanh form (GPT-2's gelu_new) as x sigmoid(2u).
void gelu(const float* x, float* y, std::int64_t n);

/// dx[i] = GELU'(x[i]) dy[i].
void gelu_backward(const float* x, const float* dy, float* dx, std::int64_t n);

}  // namespace shardlab::vmath
