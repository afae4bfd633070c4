// fp16 and bf16 conversions, over every one of the 2^32 float32 bit patterns:
// float -> fp16 against the compiler's _Float16 (IEEE round to nearest even), and
// float -> bf16 against an independent search for the nearest bf16 value.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "shardlab/half.hpp"

using namespace shardlab;

namespace {

/// Runs check(bits) for every 32-bit pattern, split over the cores; returns the number
/// of patterns where it failed and the first of them.
template <class Check>
std::pair<std::uint64_t, std::uint32_t> every_float(Check check) {
  const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::uint64_t> bad(workers, 0);
  std::vector<std::uint32_t> first(workers, 0);
  std::vector<std::thread> threads;
  for (unsigned w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      const std::uint64_t begin = (std::uint64_t{1} << 32) * w / workers;
      const std::uint64_t end = (std::uint64_t{1} << 32) * (w + 1) / workers;
      for (std::uint64_t i = begin; i < end; ++i) {
        const auto bits = static_cast<std::uint32_t>(i);
        if (!check(bits)) {
          if (bad[w]++ == 0) first[w] = bits;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  std::uint64_t total = 0;
  std::uint32_t first_bad = 0;
  for (unsigned w = 0; w < workers; ++w) {
    if (bad[w] && total == 0) first_bad = first[w];
    total += bad[w];
  }
  return {total, first_bad};
}

/// bf16's definition: float32's upper half (the library's bf16_bits_to_float is checked
/// against it for every encoding below).
float bf16_value(std::uint16_t b) { return std::bit_cast<float>(std::uint32_t{b} << 16); }

/// The bf16 nearest to f (ties to even), by comparing the two candidates around it.
std::uint16_t nearest_bf16(float f) {
  const auto x = std::bit_cast<std::uint32_t>(f);
  const auto down = static_cast<std::uint16_t>(x >> 16);  // truncation: towards zero
  const auto up = static_cast<std::uint16_t>(down + 1);   // the next one away from zero
  const double lo = std::fabs(static_cast<double>(bf16_value(down)));
  const double hi = (up & 0x7fff) == 0x7f80 ? 0x1p128  // past the largest finite: inf
                                            : std::fabs(static_cast<double>(bf16_value(up)));
  const double v = std::fabs(static_cast<double>(f));
  if (v - lo < hi - v) return down;
  if (hi - v < v - lo) return up;
  return (down & 1) ? up : down;
}

}  // namespace

TEST_SUITE("half") {
  TEST_CASE("fp16 -> float -> fp16 gives back every one of the 65536 encodings") {
    for (std::uint32_t h = 0; h < 65536; ++h) {
      const auto bits = static_cast<std::uint16_t>(h);
      const float f = half_bits_to_float(bits);
      const float theirs = static_cast<float>(std::bit_cast<_Float16>(bits));
      if (std::isnan(theirs)) {
        REQUIRE(std::isnan(f));
        continue;
      }
      REQUIRE(std::bit_cast<std::uint32_t>(f) == std::bit_cast<std::uint32_t>(theirs));
      REQUIRE(float_to_half_bits(f) == bits);
    }
  }

  TEST_CASE("float -> fp16 equals _Float16's rounding for every float32") {
    const auto [bad, first] = every_float([](std::uint32_t bits) {
      const float f = std::bit_cast<float>(bits);
      const std::uint16_t mine = float_to_half_bits(f);
      const auto theirs = std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
      if (std::isnan(f)) return !half_is_finite(mine) && (mine & 0x3ff) != 0;  // NaN stays NaN
      return mine == theirs;
    });
    CHECK_MESSAGE(bad == 0, bad << " floats convert differently, first 0x" << std::hex << first);
  }

  TEST_CASE("bf16 -> float is float32's upper half for every one of the 65536 encodings") {
    for (std::uint32_t b = 0; b < 65536; ++b) {
      const auto bits = static_cast<std::uint16_t>(b);
      REQUIRE(std::bit_cast<std::uint32_t>(bf16_bits_to_float(bits)) == b << 16);
    }
  }

  TEST_CASE("float -> bf16 rounds to the nearest bf16, ties to even, for every float32") {
    const auto [bad, first] = every_float([](std::uint32_t bits) {
      const float f = std::bit_cast<float>(bits);
      const std::uint16_t mine = float_to_bf16_bits(f);
      if (std::isnan(f)) return !bf16_is_finite(mine) && (mine & 0x7f) != 0;
      if (std::isinf(f)) return bf16_bits_to_float(mine) == f;
      return mine == nearest_bf16(f);
    });
    CHECK_MESSAGE(bad == 0, bad << " floats convert differently, first 0x" << std::hex << first);
  }

  TEST_CASE("the landmarks: 65504, 65520, 2^-24, 2^-25, and bf16's rounding") {
    CHECK(float_to_half_bits(65504.0f) == 0x7bff);
    CHECK(float_to_half_bits(65519.99f) == 0x7bff);
    CHECK(float_to_half_bits(65520.0f) == 0x7c00);  // halfway to 65536: ties to even is inf
    CHECK(float_to_half_bits(0x1.0p-24f) == 0x0001);
    CHECK(float_to_half_bits(0x1.0p-25f) == 0x0000);  // halfway to 2^-24: ties to even is 0
    CHECK(float_to_half_bits(0x1.8p-25f) == 0x0001);
    CHECK(float_to_half_bits(-0.0f) == 0x8000);
    CHECK(half_bits_to_float(0x3c00) == 1.0f);
    CHECK(float_to_bf16_bits(1.0f + 0x1.0p-8f) == 0x3f80);  // halfway: ties to even, down
    CHECK(float_to_bf16_bits(0x1.03p0f) == 0x3f82);         // halfway above an odd one: up, to even
    CHECK(float_to_bf16_bits(0x1.018p0f) == 0x3f81);        // three quarters of a step: nearest
    CHECK(bf16_bits_to_float(float_to_bf16_bits(3.0e38f)) ==
          doctest::Approx(3.0e38f).epsilon(0.01));
  }
}
