// Tensor: construction, split/concat, the CPU matmul, and printing.
#include "shardlab/tensor.hpp"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <numbers>
#include <ostream>
#include <sstream>

#include "shardlab/check.hpp"

namespace shardlab {

ShardRange shard_range(std::int64_t size, int parts, int part) {
  require(parts >= 1, "shard_range: parts must be at least 1");
  require(part >= 0 && part < parts, "shard_range: part out of range");
  const std::int64_t base = size / parts;
  const std::int64_t extra = size % parts;  // the first `extra` shards get one more
  const std::int64_t offset = part * base + std::min<std::int64_t>(part, extra);
  return {offset, base + (part < extra ? 1 : 0)};
}

Tensor::Tensor(std::int64_t n) : ndim_(1), dims_{n, 1}, data_(static_cast<std::size_t>(n)) {
  require(n >= 0, "Tensor: negative size");
}

Tensor::Tensor(std::int64_t rows, std::int64_t cols)
    : ndim_(2), dims_{rows, cols}, data_(static_cast<std::size_t>(rows * cols)) {
  require(rows >= 0 && cols >= 0, "Tensor: negative size");
}

Tensor Tensor::from(std::initializer_list<std::initializer_list<float>> rows) {
  const auto cols = rows.size() ? static_cast<std::int64_t>(rows.begin()->size()) : 0;
  Tensor t(static_cast<std::int64_t>(rows.size()), cols);
  std::int64_t r = 0;
  for (const auto& row : rows) {
    require(static_cast<std::int64_t>(row.size()) == cols, "Tensor::from: ragged rows");
    std::copy(row.begin(), row.end(), t.data() + r++ * cols);
  }
  return t;
}

Tensor Tensor::from_1d(std::initializer_list<float> values) {
  Tensor t(static_cast<std::int64_t>(values.size()));
  std::copy(values.begin(), values.end(), t.data());
  return t;
}

std::int64_t Tensor::dim(int d) const {
  require(d >= 0 && d < ndim_, "Tensor::dim: a " + std::to_string(ndim_) +
                                   "-D tensor has no dimension " + std::to_string(d));
  return dims_[d];
}

std::string Tensor::shape_string() const {
  if (ndim_ == 1) return "[" + std::to_string(dims_[0]) + "]";
  return std::to_string(dims_[0]) + "x" + std::to_string(dims_[1]);
}

bool Tensor::bitwise_equal(const Tensor& other) const {
  return same_shape(other) &&
         std::memcmp(data_.data(), other.data_.data(), data_.size() * sizeof(float)) == 0;
}

// ---------------------------------------------------------------------------
// Construction

Tensor zeros(std::int64_t rows, std::int64_t cols) { return Tensor(rows, cols); }

Tensor full(std::int64_t rows, std::int64_t cols, float value) {
  Tensor t(rows, cols);
  std::fill(t.begin(), t.end(), value);
  return t;
}

Tensor arange(std::int64_t n) {
  Tensor t(n);
  for (std::int64_t i = 0; i < n; ++i) t[i] = static_cast<float>(i);
  return t;
}

namespace {
// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and the same on every platform.
std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// A double in (0, 1]: 53 random bits, never 0 (Box-Muller takes its log).
double uniform_open0(std::uint64_t& state) {
  return (static_cast<double>(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;
}
}  // namespace

Tensor randn(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  Tensor t(rows, cols);
  std::uint64_t state = seed;
  // Box-Muller: two uniforms give two independent normals.
  for (std::int64_t i = 0; i < t.size(); i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(uniform_open0(state)));
    const double angle = 2.0 * std::numbers::pi * uniform_open0(state);
    t[i] = static_cast<float>(radius * std::cos(angle));
    if (i + 1 < t.size()) t[i + 1] = static_cast<float>(radius * std::sin(angle));
  }
  return t;
}

// ---------------------------------------------------------------------------
// Splitting and joining

namespace {
void require_2d(const Tensor& t, const char* what) {
  require(t.ndim() == 2, std::string(what) + ": needs a 2-D tensor, got " + t.shape_string());
}
}  // namespace

Tensor shard(const Tensor& t, int parts, int dim, int part) {
  require(dim == 0 || dim == 1, "split: dim must be 0 or 1");
  if (t.ndim() == 1) {
    require(dim == 0, "split: a 1-D tensor only splits along dim 0");
    const ShardRange range = shard_range(t.size(), parts, part);
    Tensor out(range.length);
    std::copy_n(t.data() + range.offset, range.length, out.data());
    return out;
  }
  const ShardRange range = shard_range(t.dim(dim), parts, part);
  if (dim == 0) {  // rows are contiguous: one copy
    Tensor out(range.length, t.cols());
    std::copy_n(t.data() + range.offset * t.cols(), range.length * t.cols(), out.data());
    return out;
  }
  Tensor out(t.rows(), range.length);  // columns: one copy per row
  for (std::int64_t r = 0; r < t.rows(); ++r)
    std::copy_n(t.data() + r * t.cols() + range.offset, range.length,
                out.data() + r * range.length);
  return out;
}

std::vector<Tensor> split(const Tensor& t, int parts, int dim) {
  std::vector<Tensor> pieces;
  pieces.reserve(static_cast<std::size_t>(parts));
  for (int p = 0; p < parts; ++p) pieces.push_back(shard(t, parts, dim, p));
  return pieces;
}

Tensor concat(const std::vector<Tensor>& pieces, int dim) {
  require(!pieces.empty(), "concat: nothing to join");
  require(dim == 0 || dim == 1, "concat: dim must be 0 or 1");
  if (pieces.front().ndim() == 1) {
    require(dim == 0, "concat: 1-D tensors only join along dim 0");
    std::int64_t n = 0;
    for (const Tensor& p : pieces) n += p.size();
    Tensor out(n);
    float* dst = out.data();
    for (const Tensor& p : pieces) dst = std::copy(p.begin(), p.end(), dst);
    return out;
  }
  const int other = 1 - dim;
  const std::int64_t fixed = pieces.front().dim(other);
  std::int64_t joined = 0;
  for (const Tensor& p : pieces) {
    require(p.ndim() == 2 && p.dim(other) == fixed,
            "concat: pieces disagree in dimension " + std::to_string(other) + " (" +
                pieces.front().shape_string() + " vs " + p.shape_string() + ")");
    joined += p.dim(dim);
  }
  if (dim == 0) {
    Tensor out(joined, fixed);
    float* dst = out.data();
    for (const Tensor& p : pieces) dst = std::copy(p.begin(), p.end(), dst);
    return out;
  }
  Tensor out(fixed, joined);
  std::int64_t col = 0;
  for (const Tensor& p : pieces) {
    for (std::int64_t r = 0; r < fixed; ++r)
      std::copy_n(p.data() + r * p.cols(), p.cols(), out.data() + r * joined + col);
    col += p.cols();
  }
  return out;
}

Tensor transpose(const Tensor& t) {
  require_2d(t, "transpose");
  Tensor out(t.cols(), t.rows());
  for (std::int64_t r = 0; r < t.rows(); ++r)
    for (std::int64_t c = 0; c < t.cols(); ++c) out(c, r) = t(r, c);
  return out;
}

// ---------------------------------------------------------------------------
// Arithmetic

Tensor matmul(const Tensor& a, const Tensor& b) {
  require_2d(a, "matmul");
  require_2d(b, "matmul");
  require(a.cols() == b.rows(),
          "matmul: inner dimensions differ (" + a.shape_string() + " @ " + b.shape_string() + ")");
  const std::int64_t M = a.rows(), K = a.cols(), N = b.cols();
  Tensor out(M, N);
  // i-k-j order: the inner loop walks rows of b and out contiguously (cache friendly,
  // vectorises), and out(i, j) still accumulates over k = 0..K-1 in order.
  for (std::int64_t i = 0; i < M; ++i) {
    float* out_row = out.data() + i * N;
    for (std::int64_t k = 0; k < K; ++k) {
      const float aik = a(i, k);
      const float* b_row = b.data() + k * N;
      for (std::int64_t j = 0; j < N; ++j) out_row[j] += aik * b_row[j];
    }
  }
  return out;
}

namespace {
void require_same_shape(const Tensor& a, const Tensor& b, const char* what) {
  require(a.same_shape(b), std::string(what) + ": shapes differ (" + a.shape_string() + " vs " +
                               b.shape_string() + ")");
}
}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  require_same_shape(a, b, "add");
  Tensor out = a;
  for (std::int64_t i = 0; i < out.size(); ++i) out[i] += b[i];
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  require_same_shape(a, b, "sub");
  Tensor out = a;
  for (std::int64_t i = 0; i < out.size(); ++i) out[i] -= b[i];
  return out;
}

Tensor scale(const Tensor& a, float s) {
  Tensor out = a;
  for (float& v : out) v *= s;
  return out;
}

void axpy(float alpha, const Tensor& x, Tensor& y) {
  require_same_shape(x, y, "axpy");
  for (std::int64_t i = 0; i < y.size(); ++i) y[i] += alpha * x[i];
}

float max_abs_diff(const Tensor& a, const Tensor& b) {
  require_same_shape(a, b, "max_abs_diff");
  float m = 0.0f;
  for (std::int64_t i = 0; i < a.size(); ++i) {
    const float d = std::fabs(a[i] - b[i]);
    if (std::isnan(d)) return d;
    m = std::max(m, d);
  }
  return m;
}

float max_abs(const Tensor& a) {
  float m = 0.0f;
  for (float v : a) {
    if (std::isnan(v)) return v;
    m = std::max(m, std::fabs(v));
  }
  return m;
}

float matmul_reorder_bound(const Tensor& a, const Tensor& b) {
  Tensor abs_a = a, abs_b = b;
  for (float& v : abs_a) v = std::fabs(v);
  for (float& v : abs_b) v = std::fabs(v);
  const double K = static_cast<double>(a.cols());
  const double u = 0x1.0p-24;
  const double gamma = K * u / (1.0 - K * u);
  return static_cast<float>(2.0 * gamma * static_cast<double>(max_abs(matmul(abs_a, abs_b))));
}

// ---------------------------------------------------------------------------
// Printing

bool use_color(int fd) { return std::getenv("NO_COLOR") == nullptr && isatty(fd) != 0; }

std::string format(const Tensor& t, const std::string& name, const PrintOptions& options) {
  // Shard p gets colour p (blue, red, green, magenta, cyan, yellow, then again).
  static const char* const colors[] = {"\033[34m", "\033[31m", "\033[32m",
                                       "\033[35m", "\033[36m", "\033[33m"};
  const char* const reset = "\033[0m";
  const int parts = std::max(1, options.shards.parts);
  const bool by_rows = options.shards.dim == 0;
  const std::int64_t rows = t.ndim() == 2 ? t.rows() : 1;
  const std::int64_t cols = t.ndim() == 2 ? t.cols() : t.size();

  // Which shard a row or column belongs to.
  auto owner = [&](std::int64_t index, std::int64_t size) {
    for (int p = 0; p < parts; ++p) {
      const ShardRange r = shard_range(size, parts, p);
      if (index < r.offset + r.length) return p;
    }
    return parts - 1;
  };
  std::ostringstream os;
  os << name << " (" << t.shape_string();
  if (parts > 1) os << ", " << parts << " shards along dim " << options.shards.dim;
  os << ")\n";
  os << std::fixed << std::setprecision(options.decimals);
  const int width = options.decimals + 4;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (by_rows && parts > 1 && !options.color && r > 0 && owner(r, rows) != owner(r - 1, rows))
      os << "  " << std::string(static_cast<std::size_t>(cols * (width + 1)), '-') << "\n";
    os << " ";
    for (std::int64_t c = 0; c < cols; ++c) {
      const int p = by_rows ? owner(r, rows) : owner(c, cols);
      if (!by_rows && parts > 1 && !options.color && c > 0 && owner(c, cols) != owner(c - 1, cols))
        os << " |";
      os << " ";
      if (options.color && parts > 1) os << colors[p % 6];
      os << std::setw(width) << (t.ndim() == 2 ? t(r, c) : t[c]);
      if (options.color && parts > 1) os << reset;
    }
    os << "\n";
  }
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << format(t, "tensor"); }

}  // namespace shardlab
