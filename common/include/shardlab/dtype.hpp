// dtype: the element types a tensor or a message holds, and where its memory lives.
//
//   f32 f64        IEEE float and double
//   f16 bf16       IEEE binary16 and bfloat16, kept as their 16-bit patterns (Half and
//                  BFloat16 below; half.hpp converts them, rounding to nearest even)
//   i32 i64 u8     integers: token ids, routing indices, byte strings
//
// Memory is host (ordinary RAM) or device (a CUDA GPU's memory, from cudaMalloc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace shardlab {

/// An fp16 value as its bits: 1 sign, 5 exponent, 10 mantissa bits (half.hpp converts).
struct Half {
  std::uint16_t bits = 0;  ///< The bit pattern.
  /// Equal bit patterns (so +0 and -0 differ, and a NaN equals itself).
  friend constexpr bool operator==(Half a, Half b) { return a.bits == b.bits; }
};
/// A bfloat16 value as its bits: 1 sign, 8 exponent, 7 mantissa bits (half.hpp converts).
struct BFloat16 {
  std::uint16_t bits = 0;  ///< The bit pattern.
  /// Equal bit patterns (so +0 and -0 differ, and a NaN equals itself).
  friend constexpr bool operator==(BFloat16 a, BFloat16 b) { return a.bits == b.bits; }
};

/// The element type of a tensor or a message.
enum class DType : std::uint8_t {
  f32,   ///< IEEE float (float).
  f64,   ///< IEEE double (double).
  f16,   ///< IEEE binary16 (Half).
  bf16,  ///< bfloat16 (BFloat16).
  i32,   ///< std::int32_t.
  i64,   ///< std::int64_t.
  u8     ///< std::uint8_t.
};

/// sum, avg (sum / N), max, min: what allreduce, reduce and reduce_scatter combine with.
/// max and min of floating values propagate NaN on every backend's host path.
enum class ReduceOp : std::uint8_t {
  sum,  ///< The sum.
  avg,  ///< The sum divided by the number of ranks N.
  max,  ///< The largest value.
  min   ///< The smallest value.
};

/// f16 or bf16: the 16-bit floating types, computed in f32 and rounded.
constexpr bool is_half(DType t) { return t == DType::f16 || t == DType::bf16; }

/// Bytes per element.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::u8:
      return 1;
  }
  return 0;
}

/// "f32", "bf16", ... (what messages and tables print).
std::string_view dtype_name(DType t);

/// True for f32, f64, f16 and bf16.
constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16;
}

/// The DType of the C++ element type T (const and volatile ignored); any type that is not
/// an Element does not compile.
template <class T>
constexpr DType dtype_of() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>)
    return DType::f32;
  else if constexpr (std::is_same_v<U, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<U, Half>)
    return DType::f16;
  else if constexpr (std::is_same_v<U, BFloat16>)
    return DType::bf16;
  else if constexpr (std::is_same_v<U, std::int32_t>)
    return DType::i32;
  else if constexpr (std::is_same_v<U, std::int64_t>)
    return DType::i64;
  else {
    static_assert(std::is_same_v<U, std::uint8_t>, "unsupported element type");
    return DType::u8;
  }
}

/// The C++ types a tensor or a buffer may hold.
template <class T>
concept Element = std::is_same_v < std::remove_cv_t<T>,
float > || std::is_same_v<std::remove_cv_t<T>, double> ||
    std::is_same_v<std::remove_cv_t<T>, Half> || std::is_same_v<std::remove_cv_t<T>, BFloat16> ||
    std::is_same_v<std::remove_cv_t<T>, std::int32_t> ||
    std::is_same_v<std::remove_cv_t<T>, std::int64_t> ||
    std::is_same_v<std::remove_cv_t<T>, std::uint8_t>;

/// Calls f(T{}) with T the C++ type of `type`: one switch for every typed loop.
template <class F>
decltype(auto) visit_dtype(DType type, F&& f) {
  switch (type) {
    case DType::f64:
      return f(double{});
    case DType::f16:
      return f(Half{});
    case DType::bf16:
      return f(BFloat16{});
    case DType::i32:
      return f(std::int32_t{});
    case DType::i64:
      return f(std::int64_t{});
    case DType::u8:
      return f(std::uint8_t{});
    case DType::f32:
      break;
  }
  return f(float{});
}

/// Where memory lives: host RAM, or the memory of a CUDA device.
enum class Memory : std::uint8_t {
  host,   ///< Ordinary RAM.
  device  ///< A CUDA GPU's memory (cudaMalloc).
};
/// "host" or "device".
constexpr std::string_view memory_name(Memory m) { return m == Memory::host ? "host" : "device"; }

}  // namespace shardlab
