// Tensor: storage and views, construction, split/concat, the arithmetic (host loops here,
// device kernels in cuda.cu through kernels.hpp), comparisons and printing.
#include "shardlab/tensor.hpp"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <iomanip>
#include <new>
#include <numbers>
#include <ostream>
#include <sstream>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "gemm.hpp"
#include "kernels.hpp"
#include "shardlab/check.hpp"
#include "shardlab/half.hpp"
#include "shardlab/memory.hpp"
#include "vector_math.hpp"

namespace shardlab {

// ---------------------------------------------------------------------------
// Types, shards and shapes

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "?";
}

ShardRange shard_range(std::int64_t size, int parts, int part) {
  require(parts >= 1, [&] {
    return "shard_range: parts must be at least 1 (got " + std::to_string(parts) + ")";
  });
  require(part >= 0 && part < parts, [&] {
    return "shard_range: part " + std::to_string(part) + " is not in 0.." +
           std::to_string(parts - 1);
  });
  require(size >= 0, [&] { return "shard_range: negative size " + std::to_string(size); });
  const std::int64_t base = size / parts;
  const std::int64_t extra = size % parts;  // the first `extra` shards get one more
  const std::int64_t offset = part * base + std::min<std::int64_t>(part, extra);
  return {offset, base + (part < extra ? 1 : 0)};
}

std::vector<std::size_t> shard_counts(std::int64_t size, int parts, std::int64_t unit) {
  std::vector<std::size_t> counts;
  for (int p = 0; p < parts; ++p)
    counts.push_back(static_cast<std::size_t>(shard_range(size, parts, p).length * unit));
  return counts;
}

Shape::Shape(std::initializer_list<std::int64_t> dims) {
  require(dims.size() >= 1 && dims.size() <= 4,
          [&] { return "Shape: 1 to 4 dimensions, got " + std::to_string(dims.size()); });
  ndim_ = static_cast<int>(dims.size());
  std::size_t d = 0;
  for (std::int64_t n : dims) {
    require(n >= 0, [&] { return "Shape: negative dimension " + std::to_string(n); });
    dims_[d++] = n;
  }
}

std::int64_t Shape::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < ndim_; ++d) n *= dims_[static_cast<std::size_t>(d)];
  return n;
}

std::string Shape::str() const {
  if (ndim_ == 1) return "[" + std::to_string(dims_[0]) + "]";
  std::string s;
  for (int d = 0; d < ndim_; ++d)
    s += (d ? "x" : "") + std::to_string(dims_[static_cast<std::size_t>(d)]);
  return s;
}

namespace {
/// `shape` with dimension d replaced by n.
Shape with_dim(const Shape& shape, int d, std::int64_t n) {
  std::int64_t dims[4] = {shape[0], shape.ndim() > 1 ? shape[1] : 1,
                          shape.ndim() > 2 ? shape[2] : 1, shape.ndim() > 3 ? shape[3] : 1};
  dims[d] = n;
  switch (shape.ndim()) {
    case 1:
      return Shape{dims[0]};
    case 2:
      return Shape{dims[0], dims[1]};
    case 3:
      return Shape{dims[0], dims[1], dims[2]};
    default:
      return Shape{dims[0], dims[1], dims[2], dims[3]};
  }
}
}  // namespace

// ---------------------------------------------------------------------------
// Storage: one allocation, freed when the last tensor viewing it goes.

/// A training step frees and allocates the same large tensors every step. By default glibc
/// maps each allocation of 128 KiB or more afresh and unmaps it when freed, so every step
/// pays page faults and the kernel's zeroing of those pages. Raising the mapping threshold
/// (to its maximum, 32 MiB) and the trim threshold keeps freed memory in the heap, where
/// the next step's tensors of the same sizes find it.
namespace {
bool keep_freed_memory() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
  return true;
}

/// Freed host storage, kept by its size for the next tensor of the same size: a training
/// step frees and allocates the same tensors every step, and taking them back from here
/// costs no call into malloc and no page faults on fresh pages (a zeroed tensor is still
/// zeroed) — what PyTorch's caching allocator does for CUDA memory. One cache per thread
/// (each rank its own, no lock); a block freed on another thread joins that thread's
/// cache. It holds at most `capacity` bytes; a failed allocation empties it and tries
/// again. Not under AddressSanitizer (the
/// learner build), which must see every free to catch a use after it.
class HostBlockCache {
 public:
#if defined(SHARDLAB_ASAN_BUILD)
  static constexpr std::size_t capacity = 0;
#else
  static constexpr std::size_t capacity = std::size_t{64} << 20;
#endif

  /// This thread's cache; nullptr while the thread is ending (after its cache has gone).
  static HostBlockCache* mine() {
    thread_local HostBlockCache cache;
    return gone_ ? nullptr : &cache;
  }

  void* take(std::size_t n) {
    const auto it = blocks_.find(n);
    if (it == blocks_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    held_ -= n;
    return p;
  }
  /// Keeps p (n bytes) for later; false when that would pass the capacity.
  bool keep(void* p, std::size_t n) {
    if (held_ + n > capacity) return false;
    blocks_[n].push_back(p);
    held_ += n;
    return true;
  }
  void release() {
    for (auto& [n, ptrs] : blocks_)
      for (void* p : ptrs) ::operator delete (p, std::align_val_t{64});
    blocks_.clear();
    held_ = 0;
  }
  ~HostBlockCache() {
    release();
    gone_ = true;
  }

 private:
  static thread_local bool gone_;
  std::unordered_map<std::size_t, std::vector<void*>> blocks_;
  std::size_t held_ = 0;
};
thread_local bool HostBlockCache::gone_ = false;

thread_local std::uint64_t host_storage_from_system = 0;

/// n bytes, 64-byte aligned (a cache line; what vector loads like) and exactly n long, so
/// that AddressSanitizer sees a write one element past the end.
void* host_alloc(std::size_t n) {
  static const bool heap_kept = keep_freed_memory();
  (void)heap_kept;
  HostBlockCache* cache = HostBlockCache::mine();
  if (cache)
    if (void* p = cache->take(n)) return p;
  ++host_storage_from_system;
  const std::size_t size = std::max<std::size_t>(n, 1);
  void* p = ::operator new (size, std::align_val_t{64}, std::nothrow);
  if (!p && cache) {
    cache->release();
    p = ::operator new (size, std::align_val_t{64}, std::nothrow);
  }
  if (!p)
    throw Error("cannot allocate " + std::to_string(n) + " bytes of host memory for a tensor");
  return p;
}

void host_free(void* p, std::size_t n) {
  HostBlockCache* cache = HostBlockCache::mine();
  if (!cache || !cache->keep(p, n)) ::operator delete (p, std::align_val_t{64});
}
}  // namespace

std::uint64_t host_storage_allocations() { return host_storage_from_system; }

struct Storage {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  Memory memory = Memory::host;
  int device = -1;
  memory::Charge charge;  // this allocation in the memory ledger (memory.hpp)

  Storage(std::size_t n, Memory m, bool zeroed) : bytes(n), memory(m), charge(n) {
    if (m == Memory::device) {
      ptr = kernels::device_alloc(std::max<std::size_t>(n, 1), &device);
      if (zeroed && n) kernels::zero(ptr, n);
      return;
    }
    ptr = host_alloc(n);
    if (zeroed) std::memset(ptr, 0, n);
  }
  ~Storage() {
    if (memory == Memory::device)
      kernels::device_free(ptr);
    else
      host_free(ptr, bytes);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

// ---------------------------------------------------------------------------
// Tensor

Tensor::Tensor() = default;

Tensor::Tensor(Shape shape, DType type, Memory memory, bool zeroed)
    : storage_(std::make_shared<Storage>(static_cast<std::size_t>(shape.numel()) * dtype_size(type),
                                         memory, zeroed)),
      shape_(shape),
      dtype_(type) {}

Tensor::Tensor(Shape shape, DType type, Memory memory) : Tensor(shape, type, memory, true) {}

Tensor::Tensor(std::int64_t n) : Tensor(Shape{n}, DType::f32, Memory::host, true) {}

Tensor::Tensor(std::int64_t rows, std::int64_t cols)
    : Tensor(Shape{rows, cols}, DType::f32, Memory::host, true) {}

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

Memory Tensor::memory() const { return storage_ ? storage_->memory : Memory::host; }
int Tensor::device() const { return storage_ ? storage_->device : -1; }

std::int64_t Tensor::dim(int d) const {
  require(d >= 0 && d < ndim(), [&] {
    return "Tensor::dim: a " + std::to_string(ndim()) + "-D tensor has no dimension " +
           std::to_string(d);
  });
  return shape_[d];
}

std::string Tensor::describe() const {
  return std::string(dtype_name(dtype_)) + " " + shape_.str() + " on " +
         std::string(memory_name(memory()));
}

void* Tensor::raw() {
  return storage_ ? static_cast<char*>(storage_->ptr) + offset_ * dtype_size(dtype_) : nullptr;
}
const void* Tensor::raw() const { return const_cast<Tensor*>(this)->raw(); }

void Tensor::check_type(DType want, const char* what) const {
  if (want != dtype_)
    throw Error(std::string("Tensor::") + what + "<" + std::string(dtype_name(want)) +
                ">: the tensor holds " + std::string(dtype_name(dtype_)));
}

void Tensor::check_host(const char* what) const {
  if (on_device())
    throw Error(std::string("Tensor::") + what + ": the tensor (" + describe() +
                ") is in device memory; copy it with to(Memory::host) first");
}

float* Tensor::host_f32() const {
  check_type(DType::f32, "element access");
  check_host("element access");
  return static_cast<float*>(const_cast<Tensor*>(this)->raw());
}

Tensor Tensor::view(std::int64_t offset, Shape shape) const {
  require(offset >= 0 && offset + shape.numel() <= size(), [&] {
    return "Tensor::view: elements " + std::to_string(offset) + ".." +
           std::to_string(offset + shape.numel()) + " of a tensor of " + std::to_string(size());
  });
  Tensor v = *this;
  v.offset_ = offset_ + offset;
  v.shape_ = shape;
  return v;
}

Tensor Tensor::reshape(Shape shape) const {
  require(shape.numel() == size(), [&] {
    return "Tensor::reshape: " + shape_.str() + " (" + std::to_string(size()) +
           " elements) cannot become " + shape.str();
  });
  return view(0, shape);
}

Tensor Tensor::flat() const { return view(0, Shape{size()}); }

Tensor Tensor::slice(std::int64_t begin, std::int64_t count) const {
  const std::int64_t n = shape_[0];
  require(begin >= 0 && count >= 0 && begin + count <= n, [&] {
    return "Tensor::slice: " + std::to_string(begin) + ".." + std::to_string(begin + count) +
           " along dimension 0 of " + shape_.str();
  });
  const std::int64_t per = n ? size() / n : 0;  // elements per entry of dimension 0
  return view(begin * per, with_dim(shape_, 0, count));
}

bool Tensor::shares_memory_with(const Tensor& other) const {
  return storage_ && storage_ == other.storage_;
}

Tensor Tensor::clone() const {
  Tensor t = shardlab::empty(shape_, dtype_, memory());
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Memory m) const {
  if (m == memory()) return *this;
  Tensor t = shardlab::empty(shape_, dtype_, m);
  t.copy_from(*this);
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  require(dtype_ == src.dtype_ && shape_ == src.shape_,
          [&] { return "Tensor::copy_from: " + src.describe() + " into " + describe(); });
  if (bytes() == 0 || raw() == src.raw()) return;
  if (!on_device() && !src.on_device())
    std::memmove(raw(), src.raw(), bytes());
  else
    kernels::copy(raw(), src.raw(), bytes());
}

void Tensor::fill(double value) {
  if (empty()) return;
  if (on_device()) return kernels::fill(raw(), size(), dtype_, value);
  visit_dtype(dtype_, [&](auto zero) {
    using T = decltype(zero);
    T v{};
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
      v = from_float<T>(static_cast<float>(value));
    else
      v = static_cast<T>(value);
    T* p = static_cast<T*>(raw());
    std::fill(p, p + size(), v);
  });
}

void Tensor::zero() {
  if (empty()) return;
  if (on_device())
    kernels::zero(raw(), bytes());
  else
    std::memset(raw(), 0, bytes());
}

bool Tensor::bitwise_equal(const Tensor& other) const {
  if (dtype_ != other.dtype_ || shape_ != other.shape_) return false;
  const Tensor a = to(Memory::host), b = other.to(Memory::host);
  return bytes() == 0 || std::memcmp(a.raw(), b.raw(), bytes()) == 0;
}

// ---------------------------------------------------------------------------
// Construction

Tensor zeros(Shape shape, DType type, Memory memory) { return Tensor(shape, type, memory); }
Tensor zeros(std::int64_t rows, std::int64_t cols) { return Tensor(rows, cols); }
Tensor empty(Shape shape, DType type, Memory memory) { return Tensor(shape, type, memory, false); }

Tensor full(Shape shape, float value, DType type) {
  Tensor t(shape, type);
  t.fill(value);
  return t;
}
Tensor full(std::int64_t rows, std::int64_t cols, float value) {
  return full(Shape{rows, cols}, value);
}

Tensor arange(std::int64_t n, DType type) {
  Tensor t(Shape{n}, type);
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    T* p = t.data<T>();
    for (std::int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
        p[i] = from_float<T>(static_cast<float>(i));
      else
        p[i] = static_cast<T>(i);
    }
  });
  return t;
}

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

namespace {
// A double in (0, 1]: 53 random bits, never 0 (Box-Muller takes its log).
double uniform_open0(std::uint64_t& state) {
  return (static_cast<double>(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;
}
}  // namespace

Tensor randn(Shape shape, std::uint64_t seed) {
  Tensor t(shape, DType::f32);
  float* p = t.data();
  std::uint64_t state = seed;
  // Box-Muller: two uniforms give two independent normals.
  for (std::int64_t i = 0; i < t.size(); i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(uniform_open0(state)));
    const double angle = 2.0 * std::numbers::pi * uniform_open0(state);
    p[i] = static_cast<float>(radius * std::cos(angle));
    if (i + 1 < t.size()) p[i + 1] = static_cast<float>(radius * std::sin(angle));
  }
  return t;
}

Tensor randn(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  return randn(Shape{rows, cols}, seed);
}

// ---------------------------------------------------------------------------
// Splitting and joining

namespace {
/// `height` rows of `width` bytes, rows `src_pitch` / `dst_pitch` apart: the one copy
/// behind column shards and column joins, on the host or on a device.
void copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
               std::size_t width, std::size_t height, Memory memory) {
  if (width == 0 || height == 0) return;
  if (memory == Memory::device)
    return kernels::copy_2d(dst, dst_pitch, src, src_pitch, width, height);
  for (std::size_t r = 0; r < height; ++r)
    std::memcpy(static_cast<char*>(dst) + r * dst_pitch,
                static_cast<const char*>(src) + r * src_pitch, width);
}

/// Elements before dimension d (outer) and after it (inner), for a row-major shape.
std::int64_t outer_of(const Shape& s, int d) {
  std::int64_t n = 1;
  for (int i = 0; i < d; ++i) n *= s[i];
  return n;
}
std::int64_t inner_of(const Shape& s, int d) {
  std::int64_t n = 1;
  for (int i = d + 1; i < s.ndim(); ++i) n *= s[i];
  return n;
}
}  // namespace

Tensor shard(const Tensor& t, int parts, int dim, int part) {
  require(dim >= 0 && dim < t.ndim(), [&] {
    return "shard: a " + std::to_string(t.ndim()) + "-D tensor has no dimension " +
           std::to_string(dim);
  });
  const ShardRange range = shard_range(t.dim(dim), parts, part);
  if (dim == 0) return t.slice(range.offset, range.length);  // contiguous: a view
  Tensor out = empty(with_dim(t.shape(), dim, range.length), t.dtype(), t.memory());
  const std::size_t elem = dtype_size(t.dtype());
  const auto inner = static_cast<std::size_t>(inner_of(t.shape(), dim));
  copy_rows(
      out.raw(), static_cast<std::size_t>(range.length) * inner * elem,
      static_cast<const char*>(t.raw()) + static_cast<std::size_t>(range.offset) * inner * elem,
      static_cast<std::size_t>(t.dim(dim)) * inner * elem,
      static_cast<std::size_t>(range.length) * inner * elem,
      static_cast<std::size_t>(outer_of(t.shape(), dim)), t.memory());
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
  const Tensor& first = pieces.front();
  require(dim >= 0 && dim < first.ndim(), [&] {
    return "concat: a " + std::to_string(first.ndim()) + "-D tensor has no dimension " +
           std::to_string(dim);
  });
  std::int64_t joined = 0;
  for (const Tensor& p : pieces) {
    require(p.dtype() == first.dtype() && p.memory() == first.memory() &&
                with_dim(p.shape(), dim, 0) == with_dim(first.shape(), dim, 0),
            [&] {
              return "concat: pieces disagree outside dimension " + std::to_string(dim) + " (" +
                     first.describe() + " vs " + p.describe() + ")";
            });
    joined += p.dim(dim);
  }
  Tensor out = empty(with_dim(first.shape(), dim, joined), first.dtype(), first.memory());
  const std::size_t elem = dtype_size(first.dtype());
  const auto inner = static_cast<std::size_t>(inner_of(first.shape(), dim));
  const auto outer = static_cast<std::size_t>(outer_of(first.shape(), dim));
  std::size_t at = 0;  // where the next piece starts along dim
  for (const Tensor& p : pieces) {
    const std::size_t width = static_cast<std::size_t>(p.dim(dim)) * inner * elem;
    copy_rows(static_cast<char*>(out.raw()) + at * inner * elem,
              static_cast<std::size_t>(joined) * inner * elem, p.raw(), width, width, outer,
              first.memory());
    at += static_cast<std::size_t>(p.dim(dim));
  }
  return out;
}

Tensor transpose(const Tensor& t) {
  require(t.ndim() == 2, [&] { return "transpose: needs a 2-D tensor, got " + t.describe(); });
  Tensor out = empty(Shape{t.cols(), t.rows()}, t.dtype(), t.memory());
  const std::size_t elem = dtype_size(t.dtype());
  if (t.on_device()) {
    if (t.size()) kernels::transpose(t.raw(), out.raw(), t.rows(), t.cols(), elem);
    return out;
  }
  const char* src = static_cast<const char*>(t.raw());
  char* dst = static_cast<char*>(out.raw());
  for (std::int64_t r = 0; r < t.rows(); ++r)
    for (std::int64_t c = 0; c < t.cols(); ++c)
      std::memcpy(dst + (c * t.rows() + r) * elem, src + (r * t.cols() + c) * elem, elem);
  return out;
}

// ---------------------------------------------------------------------------
// Arithmetic

namespace {
void require_f32(const Tensor& t, const char* what) {
  require(t.dtype() == DType::f32, [&] {
    return std::string(what) + ": needs f32, got " + t.describe() + " (cast it first)";
  });
}
void require_like(const Tensor& a, const Tensor& b, const char* what) {
  require(a.same_shape(b) && a.dtype() == b.dtype() && a.memory() == b.memory(), [&] {
    return std::string(what) + ": the tensors differ (" + a.describe() + " vs " + b.describe() +
           ")";
  });
}

/// out = op(a) @ op(b) on the host, f32, out already M x N. Every out(i, j) is summed
/// over k = 0..K-1 in order, whichever operand is transposed (so the result does not
/// depend on it): gemm.cpp's blocked kernel, bit for bit its plain reference loop.
void host_matmul_f32(const Tensor& a, const Tensor& b, bool transpose_a, bool transpose_b,
                     Tensor& out) {
  gemm::host_matmul_fast_f32(a.data(), b.data(), out.data(), out.rows(), out.cols(),
                             transpose_a ? a.rows() : a.cols(), transpose_a, transpose_b);
}

/// Elementwise out = f(a[i]) (and b[i]) over f32 host tensors.
template <class F>
Tensor host_map(const Tensor& a, F&& f) {
  Tensor out = empty(a.shape());
  const float* x = a.data();
  float* y = out.data();
  for (std::int64_t i = 0; i < a.size(); ++i) y[i] = f(x[i]);
  return out;
}
template <class F>
SHARDLAB_VECTOR_CLONES void zip_loop(const float* __restrict x, const float* __restrict z,
                                     float* __restrict y, std::int64_t n, F f) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = f(x[i], z[i]);
}
template <class F>
Tensor host_zip(const Tensor& a, const Tensor& b, F&& f) {
  Tensor out = empty(a.shape());
  zip_loop(a.data(), b.data(), out.data(), a.size(), f);
  return out;
}

Tensor binary(kernels::Binary op, const Tensor& a, const Tensor& b, const char* what) {
  require_f32(a, what);
  require_like(a, b, what);
  if (a.on_device()) {
    Tensor out = empty(a.shape(), DType::f32, Memory::device);
    kernels::binary(op, a.data(), b.data(), out.data(), a.size());
    return out;
  }
  switch (op) {
    case kernels::Binary::add:
      return host_zip(a, b, [](float x, float y) { return x + y; });
    case kernels::Binary::sub:
      return host_zip(a, b, [](float x, float y) { return x - y; });
    case kernels::Binary::mul:
      break;
  }
  return host_zip(a, b, [](float x, float y) { return x * y; });
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool transpose_a, bool transpose_b) {
  require(a.ndim() == 2 && b.ndim() == 2, [&] {
    return "matmul: needs 2-D tensors, got " + a.describe() + " and " + b.describe();
  });
  Tensor out = empty(Shape{transpose_a ? a.cols() : a.rows(), transpose_b ? b.rows() : b.cols()},
                     a.dtype(), a.memory());
  matmul_into(out, a, b, transpose_a, transpose_b);
  return out;
}

namespace {
thread_local std::uint64_t thread_multiply_adds = 0;  // this thread's matmuls' work
}  // namespace

std::uint64_t multiply_adds() { return thread_multiply_adds; }

void matmul_into(Tensor& out, const Tensor& a, const Tensor& b, bool transpose_a,
                 bool transpose_b) {
  require(a.ndim() == 2 && b.ndim() == 2, [&] {
    return "matmul: needs 2-D tensors, got " + a.describe() + " and " + b.describe();
  });
  require(a.dtype() == b.dtype() && a.memory() == b.memory(), [&] {
    return "matmul: " + a.describe() + " and " + b.describe() + " differ in type or memory";
  });
  require(a.dtype() == DType::f32 || a.dtype() == DType::f16 || a.dtype() == DType::bf16,
          [&] { return "matmul: needs f32, f16 or bf16, got " + a.describe(); });
  const std::int64_t M = transpose_a ? a.cols() : a.rows(), K = transpose_a ? a.rows() : a.cols();
  const std::int64_t Kb = transpose_b ? b.cols() : b.rows(), N = transpose_b ? b.rows() : b.cols();
  require(K == Kb, [&] {
    return "matmul: inner dimensions differ (" + a.shape_string() + (transpose_a ? "^T" : "") +
           " @ " + b.shape_string() + (transpose_b ? "^T" : "") + ")";
  });
  require(out.shape() == (Shape{M, N}) && out.dtype() == a.dtype() && out.memory() == a.memory(),
          [&] {
            return "matmul: the output is " + out.describe() + ", expected " +
                   std::string(dtype_name(a.dtype())) + " " + Shape{M, N}.str();
          });
  thread_multiply_adds +=
      static_cast<std::uint64_t>(M) * static_cast<std::uint64_t>(N) * static_cast<std::uint64_t>(K);
  if (a.on_device()) {
    if (M && N && K)
      kernels::matmul(a.raw(), b.raw(), out.raw(), a.dtype(), M, N, K, transpose_a, transpose_b,
                      a.cols(), b.cols());
    else
      out.zero();  // the answer when K is 0
    return;
  }
  if (a.dtype() != DType::f32) {  // f16 / bf16: exact in f32, accumulate there, round once
    const Tensor a32 = cast(a, DType::f32), b32 = cast(b, DType::f32);
    Tensor out32 = empty(Shape{M, N});
    host_matmul_f32(a32, b32, transpose_a, transpose_b, out32);
    out.copy_from(cast(out32, a.dtype()));
    return;
  }
  host_matmul_f32(a, b, transpose_a, transpose_b, out);
}

Tensor add(const Tensor& a, const Tensor& b) { return binary(kernels::Binary::add, a, b, "add"); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(kernels::Binary::sub, a, b, "sub"); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(kernels::Binary::mul, a, b, "mul"); }

Tensor scale(const Tensor& a, float s) {
  Tensor out = a.clone();
  scale_in_place(out, s);
  return out;
}

namespace {
// The host's loops, one per CPU (vector_math.hpp). x and y may overlap in axpy and
// add_row (the compiler checks, and takes the plain loop then).
SHARDLAB_VECTOR_CLONES void axpy_loop(float alpha, const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}
SHARDLAB_VECTOR_CLONES void scale_loop(float* y, float s, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] *= s;
}
SHARDLAB_VECTOR_CLONES void add_row_loop(float* y, const float* row, std::int64_t rows,
                                         std::int64_t cols) {
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) y[i * cols + j] += row[j];
}
SHARDLAB_VECTOR_CLONES void column_sums_loop(const float* __restrict x, float* __restrict out,
                                             std::int64_t rows, std::int64_t cols) {
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) out[j] += x[i * cols + j];
}
}  // namespace

void axpy(float alpha, const Tensor& x, Tensor& y) {
  require_f32(y, "axpy");
  require_like(x, y, "axpy");
  if (y.on_device()) return kernels::axpy(alpha, x.data(), y.data(), y.size());
  axpy_loop(alpha, x.data(), y.data(), y.size());
}

void scale_in_place(Tensor& t, float s) {
  require_f32(t, "scale");
  if (t.on_device()) return kernels::scale(t.data(), s, t.size());
  scale_loop(t.data(), s, t.size());
}

void add_row(Tensor& y, const Tensor& row) {
  require_f32(y, "add_row");
  require(y.ndim() == 2 && row.size() == y.cols() && row.dtype() == y.dtype() &&
              row.memory() == y.memory(),
          [&] {
            return "add_row: the row (" + row.describe() + ") must have one value per column of " +
                   y.describe();
          });
  if (y.on_device()) return kernels::add_row(y.data(), row.data(), y.rows(), y.cols());
  add_row_loop(y.data(), row.data(), y.rows(), y.cols());
}

Tensor column_sums(const Tensor& x) {
  require_f32(x, "column_sums");
  require(x.ndim() == 2, [&] { return "column_sums: needs a 2-D tensor, got " + x.describe(); });
  Tensor out(Shape{1, x.cols()}, DType::f32, x.memory());
  if (x.on_device()) {
    if (x.size()) kernels::column_sums(x.data(), out.data(), x.rows(), x.cols());
    return out;
  }
  column_sums_loop(x.data(), out.data(), x.rows(), x.cols());
  return out;
}

double sum_of_squares(const Tensor& x) {
  require_f32(x, "sum_of_squares");
  require(!x.on_device(),
          [&] { return "sum_of_squares: needs a host tensor, got " + x.describe(); });
  return vmath::sum_of_squares(x.data(), x.size());
}

namespace {
/// y = f(x) element by element: `kernel` on a device, `host` on the host (f(x) of one
/// element, or a loop over the array: vector_math's).
template <class Host>
Tensor unary(const Tensor& x, const char* what, void (*kernel)(const float*, float*, std::int64_t),
             Host&& host) {
  if (is_half(x.dtype()))  // f16, bf16: in f32, rounded once
    return cast(unary(cast(x, DType::f32), what, kernel, host), x.dtype());
  require_f32(x, what);
  if (!x.on_device()) {
    if constexpr (std::is_invocable_v<Host, const float*, float*, std::int64_t>) {
      Tensor y = empty(x.shape());
      host(x.data(), y.data(), x.size());
      return y;
    } else {
      return host_map(x, host);
    }
  }
  Tensor y = empty(x.shape(), DType::f32, Memory::device);
  kernel(x.data(), y.data(), x.size());
  return y;
}
/// dx = f(a, dy) element by element (a: the layer's saved input or output).
template <class Host>
Tensor gradient(const Tensor& a, const Tensor& dy, const char* what,
                void (*kernel)(const float*, const float*, float*, std::int64_t), Host&& host) {
  if (is_half(a.dtype()) && dy.dtype() == a.dtype())  // f16, bf16: in f32, rounded once
    return cast(gradient(cast(a, DType::f32), cast(dy, DType::f32), what, kernel, host), a.dtype());
  require_f32(a, what);
  require_like(a, dy, what);
  if (!a.on_device()) {
    if constexpr (std::is_invocable_v<Host, const float*, const float*, float*, std::int64_t>) {
      Tensor dx = empty(a.shape());
      host(a.data(), dy.data(), dx.data(), a.size());
      return dx;
    } else {
      return host_zip(a, dy, host);
    }
  }
  Tensor dx = empty(a.shape(), DType::f32, Memory::device);
  kernel(a.data(), dy.data(), dx.data(), a.size());
  return dx;
}
}  // namespace

Tensor tanh(const Tensor& x) {
  return unary(x, "tanh", kernels::tanh_forward, [](float v) { return std::tanh(v); });
}

Tensor tanh_backward(const Tensor& y, const Tensor& dy) {
  return gradient(y, dy, "tanh_backward", kernels::tanh_backward,
                  [](float t, float d) { return d * (1.0f - t * t); });
}

Tensor gelu(const Tensor& x) {
  // 0.5 x (1 + tanh(u)) = x sigmoid(2u): one exp, and no 1 + tanh to round (vector_math).
  return unary(x, "gelu", kernels::gelu_forward, vmath::gelu);
}

Tensor gelu_backward(const Tensor& x, const Tensor& dy) {
  return gradient(x, dy, "gelu_backward", kernels::gelu_backward, vmath::gelu_backward);
}

Tensor cast(const Tensor& t, DType type) {
  if (type == t.dtype()) return t.clone();
  Tensor out = empty(t.shape(), type, t.memory());
  if (t.on_device()) {
    if (t.size()) kernels::cast(t.raw(), t.dtype(), out.raw(), type, t.size());
    return out;
  }
  visit_dtype(t.dtype(), [&](auto from) {
    using From = decltype(from);
    const From* in = static_cast<const From*>(t.raw());
    visit_dtype(type, [&](auto to) {
      using To = decltype(to);
      To* o = static_cast<To*>(out.raw());
      for (std::int64_t i = 0; i < t.size(); ++i) {
        if constexpr (std::is_same_v<To, Half> || std::is_same_v<To, BFloat16>)
          o[i] = from_float<To>(static_cast<float>(to_double(in[i])));
        else
          o[i] = static_cast<To>(to_double(in[i]));
      }
    });
  });
  return out;
}

Tensor round_to(const Tensor& t, DType type) {
  if (type == DType::f32) return t;
  require(t.dtype() == DType::f32 && is_half(type), [&] {
    return "round_to: " + t.describe() + " to " + std::string(dtype_name(type)) +
           ": f32 values, rounded to f16 or bf16";
  });
  return cast(cast(t, type), DType::f32);
}

namespace {
void require_index(const Tensor& index, const char* what) {
  require(index.ndim() == 1 && (index.dtype() == DType::i32 || index.dtype() == DType::i64), [&] {
    return std::string(what) + ": the index must be a 1-D i32 or i64 tensor, got " +
           index.describe();
  });
}
std::int64_t index_at(const Tensor& index, std::int64_t i) {
  return index.dtype() == DType::i32 ? index.data<std::int32_t>()[i]
                                     : index.data<std::int64_t>()[i];
}
[[noreturn]] void bad_index(const char* what, std::int64_t i, std::int64_t value,
                            std::int64_t rows) {
  throw Error(std::string(what) + ": index[" + std::to_string(i) + "] = " + std::to_string(value) +
              " is outside 0.." + std::to_string(rows - 1));
}
}  // namespace

Tensor index_rows(const Tensor& src, const Tensor& index) {
  require_index(index, "index_rows");
  require(index.memory() == src.memory(),
          "index_rows: the index and the rows are in different memory");
  const std::int64_t rows = src.dim(0), n = index.size();
  Tensor out = empty(with_dim(src.shape(), 0, n), src.dtype(), src.memory());
  const std::size_t row_bytes = rows ? src.bytes() / static_cast<std::size_t>(rows)
                                     : static_cast<std::size_t>(src.ndim() > 1 ? src.size() : 0);
  if (src.on_device()) {
    if (n &&
        !kernels::index_rows(src.raw(), rows, row_bytes, index.raw(), index.dtype(), n, out.raw()))
      throw Error("index_rows: an index is outside 0.." + std::to_string(rows - 1));
    return out;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t r = index_at(index, i);
    if (r < 0 || r >= rows) bad_index("index_rows", i, r, rows);
    std::memcpy(static_cast<char*>(out.raw()) + static_cast<std::size_t>(i) * row_bytes,
                static_cast<const char*>(src.raw()) + static_cast<std::size_t>(r) * row_bytes,
                row_bytes);
  }
  return out;
}

void scatter_add_rows(Tensor& dst, const Tensor& index, const Tensor& src) {
  require_index(index, "scatter_add_rows");
  require_f32(dst, "scatter_add_rows");
  require(src.dtype() == DType::f32 && src.memory() == dst.memory() &&
              index.memory() == dst.memory() && src.dim(0) == index.size() &&
              src.size() == index.size() * (dst.dim(0) ? dst.size() / dst.dim(0) : 0),
          [&] {
            return "scatter_add_rows: " + src.describe() + " rows into " + dst.describe() + " by " +
                   index.describe();
          });
  const std::int64_t rows = dst.dim(0), n = index.size();
  const std::int64_t cols = n ? src.size() / n : 0;
  if (dst.on_device()) {
    if (n && !kernels::scatter_add_rows(dst.data(), rows, cols, index.raw(), index.dtype(), n,
                                        src.data()))
      throw Error("scatter_add_rows: an index is outside 0.." + std::to_string(rows - 1));
    return;
  }
  const float* s = src.data();
  float* d = dst.data();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t r = index_at(index, i);
    if (r < 0 || r >= rows) bad_index("scatter_add_rows", i, r, rows);
    for (std::int64_t j = 0; j < cols; ++j) d[r * cols + j] += s[i * cols + j];
  }
}

// ---------------------------------------------------------------------------
// Comparing

namespace {
void require_floating(const Tensor& t, const char* what) {
  require(is_floating(t.dtype()),
          [&] { return std::string(what) + ": needs a floating type, got " + t.describe(); });
}
}  // namespace

double max_abs_diff(const Tensor& a, const Tensor& b) {
  require_floating(a, "max_abs_diff");
  require_like(a, b, "max_abs_diff");
  if (a.on_device()) return kernels::max_abs_diff(a.raw(), b.raw(), a.dtype(), a.size());
  return visit_dtype(a.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* x = static_cast<const T*>(a.raw());
    const T* y = static_cast<const T*>(b.raw());
    double m = 0;
    for (std::int64_t i = 0; i < a.size(); ++i) {
      const double d = std::fabs(to_double(x[i]) - to_double(y[i]));
      if (std::isnan(d)) return d;
      m = std::max(m, d);
    }
    return m;
  });
}

double max_abs(const Tensor& a) {
  require_floating(a, "max_abs");
  if (a.on_device()) return kernels::max_abs_diff(a.raw(), nullptr, a.dtype(), a.size());
  return visit_dtype(a.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* x = static_cast<const T*>(a.raw());
    double m = 0;
    for (std::int64_t i = 0; i < a.size(); ++i) {
      const double v = std::fabs(to_double(x[i]));
      if (std::isnan(v)) return v;
      m = std::max(m, v);
    }
    return m;
  });
}

bool all_finite(const Tensor& t) {
  if (!is_floating(t.dtype())) return true;
  if (t.on_device()) return kernels::all_finite(t.raw(), t.dtype(), t.size());
  return visit_dtype(t.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* x = static_cast<const T*>(t.raw());
    for (std::int64_t i = 0; i < t.size(); ++i)
      if (!std::isfinite(to_double(x[i]))) return false;
    return true;
  });
}

float matmul_reorder_bound(const Tensor& a, const Tensor& b) {
  Tensor abs_a = cast(a.to(Memory::host), DType::f32), abs_b = cast(b.to(Memory::host), DType::f32);
  for (float& v : abs_a) v = std::fabs(v);
  for (float& v : abs_b) v = std::fabs(v);
  const double K = static_cast<double>(a.cols());
  const double u = 0x1.0p-24;
  const double gamma = K * u / (1.0 - K * u);
  return static_cast<float>(2.0 * gamma * max_abs(matmul(abs_a, abs_b)));
}

// ---------------------------------------------------------------------------
// Printing

bool use_color(int fd) { return std::getenv("NO_COLOR") == nullptr && isatty(fd) != 0; }

std::string format(const Tensor& tensor, const std::string& name, const PrintOptions& options) {
  require(tensor.ndim() <= 2,
          [&] { return "format: prints 1-D and 2-D tensors, got " + tensor.describe(); });
  const Tensor t = cast(tensor.to(Memory::host), DType::f64);
  const double* values = t.data<double>();
  const bool integer = !is_floating(tensor.dtype());
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
  os << name << " (" << tensor.shape_string();
  if (tensor.dtype() != DType::f32) os << ", " << dtype_name(tensor.dtype());
  if (parts > 1) os << ", " << parts << " shards along dim " << options.shards.dim;
  os << ")\n";
  const int decimals = integer ? 0 : options.decimals;
  os << std::fixed << std::setprecision(decimals);
  const int width = decimals + 4 + (integer ? 2 : 0);
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
      os << std::setw(width) << values[r * cols + c];
      if (options.color && parts > 1) os << reset;
    }
    os << "\n";
  }
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << format(t, "tensor"); }

}  // namespace shardlab
