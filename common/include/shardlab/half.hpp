// half: IEEE binary16 (fp16) and bfloat16 conversions, written out.
//
//   fp16  1 sign, 5 exponent (bias 15), 10 mantissa bits: max 65504, smallest normal 2^-14,
//         smallest subnormal 2^-24
//   bf16  1 sign, 8 exponent (bias 127), 7 mantissa bits: float32's range, 8 bits of
//         precision
//
// float -> half rounds to nearest, ties to even (IEEE 754's default), gives subnormals
// below 2^-14, infinity from 65520 up (the halfway point above 65504), and keeps NaN a
// (quiet) NaN. half -> float is exact. Checked against the compiler's _Float16 over every
// float32 (test_half.cpp); bf16 against an independent nearest-value search.
#pragma once

#include <cstdint>

#include "shardlab/dtype.hpp"

namespace shardlab {

/// `f` rounded to the nearest fp16 (ties to even), as its bit pattern.
std::uint16_t float_to_half_bits(float f);
/// The fp16 pattern `h` as a float (exact).
float half_bits_to_float(std::uint16_t h);
/// `f` rounded to the nearest bf16 (ties to even), as its bit pattern.
std::uint16_t float_to_bf16_bits(float f);
/// The bf16 pattern `b` as a float (exact).
float bf16_bits_to_float(std::uint16_t b);

/// True when the fp16 / bf16 pattern is a finite number; false for +-inf and NaN (the
/// exponent bits all set).
inline bool half_is_finite(std::uint16_t h) { return (h & 0x7c00) != 0x7c00; }
/// The same for a bf16 pattern.
inline bool bf16_is_finite(std::uint16_t b) { return (b & 0x7f80) != 0x7f80; }

// The same on the typed values (dtype.hpp), for loops over tensors of any element type:
// to_float(x) for every Element, from_float<T>(f) rounding as above for the 16-bit types.
/// `h` as a float (exact).
inline float to_float(Half h) { return half_bits_to_float(h.bits); }
/// `b` as a float (exact).
inline float to_float(BFloat16 b) { return bf16_bits_to_float(b.bits); }
/// `x` of any Element type as a double (exact but for i64 beyond 2^53).
template <class T>
inline double to_double(T x) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
    return static_cast<double>(to_float(x));
  else
    return static_cast<double>(x);
}
/// `f` as a T: rounded to nearest even for Half and BFloat16, a static_cast otherwise.
template <class T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, Half>)
    return Half{float_to_half_bits(f)};
  else if constexpr (std::is_same_v<T, BFloat16>)
    return BFloat16{float_to_bf16_bits(f)};
  else
    return static_cast<T>(f);
}

}  // namespace shardlab
