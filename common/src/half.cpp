// half: fp16 and bf16 conversions (see half.hpp).
#include "shardlab/half.hpp"

#include <bit>

namespace shardlab {

std::uint16_t float_to_half_bits(float f) {
  const auto x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000);
  const std::uint32_t abs = x & 0x7fffffff;
  if (abs >= 0x7f800000)  // inf stays inf; NaN stays NaN (quiet bit set, top payload kept)
    return static_cast<std::uint16_t>(sign | 0x7c00 |
                                      (abs > 0x7f800000 ? 0x200 | ((abs >> 13) & 0x3ff) : 0));
  if (abs >= 0x477ff000)
    return static_cast<std::uint16_t>(sign | 0x7c00);  // >= 65520: rounds to inf
  if (abs < 0x38800000) {
    // Below 2^-14: a subnormal, q units of 2^-24. The float is m * 2^(e-150) with the
    // implicit bit in m, so q = m >> (126 - e), rounded to nearest even.
    const int e = static_cast<int>(abs >> 23);
    if (e < 102) return sign;  // below 2^-25: rounds to zero
    const std::uint32_t m = (abs & 0x7fffff) | 0x800000;
    const int shift = 126 - e;
    std::uint32_t q = m >> shift;
    const std::uint32_t rest = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (q & 1))) ++q;  // may carry into the smallest normal
    return static_cast<std::uint16_t>(sign | q);
  }
  // Normal: rebias the exponent (127 -> 15), keep the top 10 mantissa bits, round the
  // other 13 to nearest even (a carry correctly bumps the exponent).
  std::uint32_t h = ((abs >> 23) - 112) << 10 | ((abs & 0x7fffff) >> 13);
  const std::uint32_t rest = abs & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000) << 16;
  const std::uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
    const float v = static_cast<float>(m) * 0x1.0p-24f;
    return sign ? -v : v;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000 | (m << 13));  // inf, NaN
  return std::bit_cast<float>(sign | ((e + 112) << 23) | (m << 13));
}

std::uint16_t float_to_bf16_bits(float f) {
  const auto x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffff) > 0x7f800000)
    return static_cast<std::uint16_t>((x >> 16) | 0x40);  // quiet NaN
  // Round the low 16 bits to nearest even: add 0x7fff, plus 1 when the kept part is odd.
  const std::uint32_t rounded = x + 0x7fff + ((x >> 16) & 1);
  return static_cast<std::uint16_t>(rounded >> 16);
}

float bf16_bits_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace shardlab
