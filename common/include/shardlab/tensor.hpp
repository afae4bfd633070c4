// Tensor: the one data type the chapters compute with.
//
// float32, row-major, 1-D or 2-D, always contiguous and owning its memory. Small on
// purpose: it is read as much as it is used. Names used for shapes throughout:
//   M, K, N  = matmul dims (x is M x K, w is K x N), P = number of parts, p = part index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iosfwd>
#include <span>
#include <string>
#include <vector>

namespace shardlab {

/// Where shard p of P parts of a length-`size` dimension starts, and how long it is.
/// Uneven sizes: the first size % P shards get one element more (PyTorch's
/// tensor_split and Megatron's divide do the same).
struct ShardRange {
  std::int64_t offset = 0;
  std::int64_t length = 0;
};
ShardRange shard_range(std::int64_t size, int parts, int part);

class Tensor {
 public:
  Tensor() = default;
  /// A 1-D tensor of n zeros.
  explicit Tensor(std::int64_t n);
  /// A 2-D tensor of rows x cols zeros.
  Tensor(std::int64_t rows, std::int64_t cols);
  /// A 2-D tensor from nested values: Tensor::from({{1, 2}, {3, 4}}).
  static Tensor from(std::initializer_list<std::initializer_list<float>> rows);
  /// A 1-D tensor from values.
  static Tensor from_1d(std::initializer_list<float> values);

  int ndim() const { return ndim_; }
  /// Length of dimension d (0 or 1); a 1-D tensor has only dimension 0.
  std::int64_t dim(int d) const;
  std::int64_t rows() const { return dim(0); }
  std::int64_t cols() const { return dim(1); }
  std::int64_t size() const { return static_cast<std::int64_t>(data_.size()); }
  bool empty() const { return data_.empty(); }
  std::string shape_string() const;  // "4x5" or "[8]"

  float* data() { return data_.data(); }
  const float* data() const { return data_.data(); }
  float* begin() { return data_.data(); }
  float* end() { return data_.data() + data_.size(); }
  const float* begin() const { return data_.data(); }
  const float* end() const { return data_.data() + data_.size(); }
  std::span<float> span() { return data_; }
  std::span<const float> span() const { return data_; }

  float& operator[](std::int64_t i) { return data_[static_cast<std::size_t>(i)]; }
  float operator[](std::int64_t i) const { return data_[static_cast<std::size_t>(i)]; }
  float& operator()(std::int64_t r, std::int64_t c) { return data_[index(r, c)]; }
  float operator()(std::int64_t r, std::int64_t c) const { return data_[index(r, c)]; }

  bool same_shape(const Tensor& other) const {
    return ndim_ == other.ndim_ && dims_[0] == other.dims_[0] && dims_[1] == other.dims_[1];
  }
  /// Same shape and the same bits in every element.
  bool bitwise_equal(const Tensor& other) const;

 private:
  std::size_t index(std::int64_t r, std::int64_t c) const {
    return static_cast<std::size_t>(r * dims_[1] + c);
  }
  int ndim_ = 1;
  std::int64_t dims_[2] = {0, 1};
  std::vector<float> data_;
};

// ---------------------------------------------------------------------------
// Construction

Tensor zeros(std::int64_t rows, std::int64_t cols);
Tensor full(std::int64_t rows, std::int64_t cols, float value);
/// 1-D tensor 0, 1, ..., n-1.
Tensor arange(std::int64_t n);
/// rows x cols standard normal values from `seed`. The generator (SplitMix64 +
/// Box-Muller) is written out, so every rank, backend and platform draws the same.
Tensor randn(std::int64_t rows, std::int64_t cols, std::uint64_t seed);

// ---------------------------------------------------------------------------
// Splitting and joining

/// Splits t into `parts` pieces along `dim` (0 = rows, 1 = columns of a 2-D tensor);
/// uneven sizes as shard_range says. A part may be empty when parts > size.
std::vector<Tensor> split(const Tensor& t, int parts, int dim);
/// Piece `part` of split(t, parts, dim), without building the others.
Tensor shard(const Tensor& t, int parts, int dim, int part);
/// Joins pieces along `dim`; the other dimension must agree.
Tensor concat(const std::vector<Tensor>& pieces, int dim);
/// The transpose of a 2-D tensor.
Tensor transpose(const Tensor& t);

// ---------------------------------------------------------------------------
// Arithmetic

/// out = a @ b, a is M x K, b is K x N. Each out(i, j) is summed over k in order
/// 0..K-1, so a matmul of a row or column shard gives bit-identical elements.
Tensor matmul(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor scale(const Tensor& a, float s);
/// y += alpha * x, in place.
void axpy(float alpha, const Tensor& x, Tensor& y);
/// max |a - b| over all elements (the shapes must agree); NaN anywhere gives NaN.
float max_abs_diff(const Tensor& a, const Tensor& b);
/// max |a| over all elements.
float max_abs(const Tensor& a);
/// How far two float32 computations of a @ b that sum over k in different orders can
/// differ: 2 * K * u * max over (i, j) of sum_k |a(i,k)| |b(k,j)|, u = 2^-24 (Higham,
/// Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1: each order is within
/// gamma_K = K u / (1 - K u) of the exact sum). Row-parallel results are checked with it.
float matmul_reorder_bound(const Tensor& a, const Tensor& b);

// ---------------------------------------------------------------------------
// Printing

/// How to show shards when printing: split along `dim` into `parts` coloured pieces.
struct ShardView {
  int parts = 1;
  int dim = 0;
};
struct PrintOptions {
  ShardView shards{};
  int decimals = 3;
  bool color = false;  // ANSI colours, one per shard; use_color() decides for a stream
};
/// True when `fd` is a terminal and NO_COLOR is unset.
bool use_color(int fd);
/// Prints `name` (shape) and the values, one row per line, shards in colour or,
/// without colour, separated by '|' (columns) or a dashed line (rows).
std::string format(const Tensor& t, const std::string& name, const PrintOptions& options = {});
std::ostream& operator<<(std::ostream& os, const Tensor& t);

}  // namespace shardlab
