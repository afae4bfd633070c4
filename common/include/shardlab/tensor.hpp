// Tensor: the one data type the chapters compute with.
//
// A tensor is a typed view of memory: an element type (dtype.hpp: f32, f64, f16, bf16,
// i32, i64, u8), a row-major shape of 1 to 4 dimensions, and a place in a shared
// allocation (an offset) on the host or on a CUDA device. It is a handle, as in PyTorch:
// copying a Tensor shares its data; clone() copies the data. Views never copy: a row
// slice, a shard of a flat buffer, a parameter inside one big allocation (nn.hpp's
// ParameterStore) are tensors over the same memory. Every tensor is contiguous, so a view
// is a range of elements; splitting columns makes copies.
//
// The operations below run where their tensors live: a loop on the host, a kernel or
// cuBLAS on a GPU (same results within the rounding each states). Shapes used throughout:
//   M, K, N  = matmul dims (a is M x K, b is K x N), P = number of parts, p = part index.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shardlab/dtype.hpp"

namespace shardlab {

/// `i` (an int, a count) as an index into a std::vector, which counts in size_t: the one
/// cast the chapters' loops need, written once.
constexpr std::size_t idx(std::int64_t i) { return static_cast<std::size_t>(i); }

/// Where shard p of P parts of a length-`size` dimension starts, and how long it is.
/// Uneven sizes: the first size % P shards get one element more (PyTorch's
/// tensor_split and Megatron's divide do the same).
struct ShardRange {
  std::int64_t offset = 0;  ///< The shard's first index along the dimension.
  std::int64_t length = 0;  ///< The number of indices it has.
};
/// Shard `part` of `parts` of a dimension of length `size`, as ShardRange says. Throws
/// Error unless parts >= 1, 0 <= part < parts and size >= 0.
ShardRange shard_range(std::int64_t size, int parts, int part);
/// The lengths of all P shards of `size`, each times `unit`: the counts an allgatherv of
/// row shards takes (unit = elements per row).
std::vector<std::size_t> shard_counts(std::int64_t size, int parts, std::int64_t unit = 1);

/// A shape of 1 to 4 dimensions: Shape{4, 5} is 4 rows of 5.
class Shape {
 public:
  Shape() = default;  ///< One dimension of length 0: [0].
  /// The lengths, outermost first; throws Error unless there are 1 to 4, none negative.
  Shape(std::initializer_list<std::int64_t> dims);
  /// The number of dimensions, 1 to 4.
  int ndim() const { return ndim_; }
  /// The length of dimension `d` (unchecked: 1 for ndim() <= d < 4).
  std::int64_t operator[](int d) const { return dims_[static_cast<std::size_t>(d)]; }
  /// The number of elements: the product of the dimensions.
  std::int64_t numel() const;
  /// "4x5", or "[8]" for one dimension.
  std::string str() const;
  /// The same number of dimensions, and the same lengths.
  friend bool operator==(const Shape& a, const Shape& b) {
    return a.ndim_ == b.ndim_ && a.dims_ == b.dims_;
  }

 private:
  int ndim_ = 1;
  std::array<std::int64_t, 4> dims_{0, 1, 1, 1};
};

struct Storage;  // one allocation: host memory or cudaMalloc'd device memory

/// A typed view of host or device memory: an element type, a row-major shape and an
/// offset into a shared allocation; always contiguous. A handle: copying a Tensor shares
/// its data (clone() copies the data).
class Tensor {
 public:
  /// An empty 1-D f32 tensor on the host.
  Tensor();
  /// A 1-D f32 tensor of n zeros on the host.
  explicit Tensor(std::int64_t n);
  /// A rows x cols f32 tensor of zeros on the host.
  Tensor(std::int64_t rows, std::int64_t cols);
  /// A tensor of zeros of any shape and type, on the host or on this thread's GPU.
  Tensor(Shape shape, DType type, Memory memory = Memory::host);
  /// A 2-D f32 tensor from nested values: Tensor::from({{1, 2}, {3, 4}}).
  static Tensor from(std::initializer_list<std::initializer_list<float>> rows);
  /// A 1-D f32 tensor from values.
  static Tensor from_1d(std::initializer_list<float> values);
  /// A 1-D tensor holding `values` (any element type: indices, bytes, halves).
  template <Element T>
  static Tensor from_vector(const std::vector<T>& values);

  /// The element type.
  DType dtype() const { return dtype_; }
  /// Where the elements are: host or device memory (host for a default-constructed one).
  Memory memory() const;
  /// True when the elements are in device memory.
  bool on_device() const { return memory() == Memory::device; }
  /// The CUDA device the memory is on, or -1 on the host.
  int device() const;
  /// The shape.
  const Shape& shape() const { return shape_; }
  /// The number of dimensions, 1 to 4.
  int ndim() const { return shape_.ndim(); }
  /// Length of dimension d.
  std::int64_t dim(int d) const;
  /// Length of dimension 0: a matrix's rows.
  std::int64_t rows() const { return dim(0); }
  /// Length of dimension 1: a matrix's columns (throws Error for a 1-D tensor).
  std::int64_t cols() const { return dim(1); }
  /// Number of elements.
  std::int64_t size() const { return shape_.numel(); }
  /// True when it has no elements.
  bool empty() const { return size() == 0; }
  /// False for a default-constructed Tensor (no memory at all), true for any other,
  /// zero-sized ones included.
  bool defined() const { return storage_ != nullptr; }
  /// The size of the elements in bytes: size() times the element size.
  std::size_t bytes() const { return static_cast<std::size_t>(size()) * dtype_size(dtype_); }
  /// The shape as Shape::str() writes it: "4x5", "[8]".
  std::string shape_string() const { return shape_.str(); }
  /// "f32 4x5 on host": for error messages.
  std::string describe() const;

  // -- data ---------------------------------------------------------------------
  /// The first element's address (host or device memory), untyped.
  void* raw();
  /// The first element's address, read-only.
  const void* raw() const;
  /// Typed pointer to the first element; T must be the element type.
  template <Element T>
  T* data() {
    check_type(dtype_of<T>(), "data");
    return static_cast<T*>(raw());
  }
  /// Typed read-only pointer to the first element; T must be the element type.
  template <Element T>
  const T* data() const {
    check_type(dtype_of<T>(), "data");
    return static_cast<const T*>(raw());
  }
  /// f32 shortcuts (the common case).
  float* data() { return data<float>(); }
  /// f32 shortcut, read-only.
  const float* data() const { return data<float>(); }
  /// The elements as a span: host memory only (checked), T the element type.
  template <Element T>
  std::span<T> span() {
    check_host("span");
    return {data<T>(), static_cast<std::size_t>(size())};
  }
  /// The elements as a read-only span: host memory only (checked), T the element type.
  template <Element T>
  std::span<const T> span() const {
    check_host("span");
    return {data<T>(), static_cast<std::size_t>(size())};
  }
  /// The elements of an f32 tensor as a span (host memory only, checked).
  std::span<float> span() { return span<float>(); }
  /// The elements of an f32 tensor as a read-only span (host memory only, checked).
  std::span<const float> span() const { return span<float>(); }

  // Element access and iteration, for f32 tensors on the host (checked).
  /// Element i, counted row-major over all dimensions (the index is not checked).
  float& operator[](std::int64_t i) { return host_f32()[i]; }
  /// Element i's value, counted row-major over all dimensions (the index is not checked).
  float operator[](std::int64_t i) const { return host_f32()[i]; }
  /// Element (r, c) of a matrix (the indices are not checked).
  float& operator()(std::int64_t r, std::int64_t c) { return host_f32()[r * cols() + c]; }
  /// Element (r, c)'s value of a matrix (the indices are not checked).
  float operator()(std::int64_t r, std::int64_t c) const { return host_f32()[r * cols() + c]; }
  /// The first element, for range-for.
  float* begin() { return host_f32(); }
  /// One past the last element.
  float* end() { return host_f32() + size(); }
  /// The first element, read-only, for range-for.
  const float* begin() const { return host_f32(); }
  /// One past the last element, read-only.
  const float* end() const { return host_f32() + size(); }

  // -- views: share the memory, never copy -----------------------------------------
  /// Elements [offset, offset + shape.numel()) of this tensor (read row-major), as `shape`.
  Tensor view(std::int64_t offset, Shape shape) const;
  /// The same elements in another shape of equal size.
  Tensor reshape(Shape shape) const;
  /// All elements as one dimension.
  Tensor flat() const;
  /// `count` entries along dimension 0 from `begin`: rows of a matrix, elements of a vector.
  Tensor slice(std::int64_t begin, std::int64_t count) const;
  /// True when both tensors are views of one allocation.
  bool shares_memory_with(const Tensor& other) const;

  // -- copies ---------------------------------------------------------------------
  /// A copy of the data, in the same memory.
  Tensor clone() const;
  /// This tensor in `memory`: itself when it is already there, else a copy.
  Tensor to(Memory memory) const;
  /// Copies `src` (same shape and type, any memory) into this tensor's elements.
  void copy_from(const Tensor& src);
  /// Sets every element to `value` (converted to the element type).
  void fill(double value);
  /// Sets every element to zero (all bits zero).
  void zero();

  /// Same type, same shape and the same bits in every element (host or device).
  bool bitwise_equal(const Tensor& other) const;
  /// True when the shapes are equal (types and memory are not compared).
  bool same_shape(const Tensor& other) const { return shape_ == other.shape_; }

 private:
  friend Tensor empty(Shape shape, DType type, Memory memory);
  Tensor(Shape shape, DType type, Memory memory, bool zeroed);
  void check_type(DType want, const char* what) const;
  void check_host(const char* what) const;
  float* host_f32() const;
  std::shared_ptr<Storage> storage_;
  std::int64_t offset_ = 0;  // in elements
  Shape shape_;
  DType dtype_ = DType::f32;
};

// ---------------------------------------------------------------------------
// Construction

/// Zeros of any shape and type, on the host or on this thread's GPU.
Tensor zeros(Shape shape, DType type = DType::f32, Memory memory = Memory::host);
/// A rows x cols f32 tensor of zeros on the host.
Tensor zeros(std::int64_t rows, std::int64_t cols);
/// As zeros, but leaves the memory uninitialised (for buffers about to be overwritten).
Tensor empty(Shape shape, DType type = DType::f32, Memory memory = Memory::host);
/// `value` (converted to `type`) in every element, on the host.
Tensor full(Shape shape, float value, DType type = DType::f32);
/// A rows x cols f32 tensor of `value` on the host.
Tensor full(std::int64_t rows, std::int64_t cols, float value);
/// 1-D tensor 0, 1, ..., n-1.
Tensor arange(std::int64_t n, DType type = DType::f32);
/// SplitMix64 (Steele, Lea, Flood 2014): the next 64 random bits of `state`, which it
/// advances; tiny, fast, and the same on every platform (randn draws from it).
std::uint64_t splitmix64(std::uint64_t& state);
/// Standard normal f32 values from `seed`. The generator (SplitMix64 + Box-Muller) is
/// written out, so every rank, backend and platform draws the same.
Tensor randn(Shape shape, std::uint64_t seed);
/// randn(Shape{rows, cols}, seed).
Tensor randn(std::int64_t rows, std::int64_t cols, std::uint64_t seed);

// ---------------------------------------------------------------------------
// Splitting and joining (any type, host or device)

/// Piece `part` of `parts` along `dim`, uneven sizes as shard_range says. Along dim 0 it
/// is a view (rows are contiguous); along another dim it is a copy.
Tensor shard(const Tensor& t, int parts, int dim, int part);
/// All the pieces of shard(). A piece may be empty when parts > size.
std::vector<Tensor> split(const Tensor& t, int parts, int dim);
/// Joins pieces along `dim`; the other dimensions must agree. Always a new tensor.
Tensor concat(const std::vector<Tensor>& pieces, int dim);
/// The transpose of a 2-D tensor (a copy).
Tensor transpose(const Tensor& t);

// ---------------------------------------------------------------------------
// Arithmetic. f32 unless stated; host loops or device kernels, by where the tensors are.

/// out = op(a) @ op(b), op transposing a (or b) where asked; a is M x K, b is K x N after
/// op. Host: each out(i, j) is summed over k in order 0..K-1, so a matmul of a row or
/// column shard gives bit-identical elements. Device: cuBLAS (FP32 math, no TF32). f16
/// and bf16 inputs give an output of the same type, accumulated in f32 and rounded once
/// (cuBLAS: cublasGemmEx with CUBLAS_COMPUTE_32F).
Tensor matmul(const Tensor& a, const Tensor& b, bool transpose_a = false, bool transpose_b = false);
/// The same into `out` (M x N, of a's type and memory), overwriting it: no allocation, for
/// loops that reuse one output (a benchmark).
void matmul_into(Tensor& out, const Tensor& a, const Tensor& b, bool transpose_a = false,
                 bool transpose_b = false);
/// The definition of the host f32 matmul: plain loops taking each out(i, j) from +0 through
/// one fused multiply-add per k, `sum = fma(a(i, k), b(k, j), sum)`, k = 0..K-1 in order.
/// Host matmul gives these bits (it runs a blocked kernel, gemm.cpp); tests and the
/// chapter 01 benchmark compare with it. f32 host tensors only; not counted in
/// multiply_adds().
Tensor matmul_reference(const Tensor& a, const Tensor& b, bool transpose_a = false,
                        bool transpose_b = false);
/// The same into `out` (M x N, f32, host), overwriting it.
void matmul_reference_into(Tensor& out, const Tensor& a, const Tensor& b, bool transpose_a = false,
                           bool transpose_b = false);
/// The host matmul's kernel: "avx512", "avx2" or "reference" (the fastest this CPU runs,
/// or the one the environment variable SHARDLAB_GEMM names; UsageError if it names none
/// this CPU runs).
const char* host_matmul_kernel();
/// Host tensor storages the calling thread has taken from the system allocator rather than
/// from its cache of freed blocks (tensor.cpp): a training step in its steady state takes
/// none. Under AddressSanitizer there is no cache, and every storage counts.
std::uint64_t host_storage_allocations();
/// The multiply-adds (M x K x N per matmul) the calling thread's matmuls have done so far.
/// Each rank's thread counts its own: a test reads it to see that every rank did its
/// share of the work, and no more.
std::uint64_t multiply_adds();
/// Element by element: a + b (f32; the same shape and memory).
Tensor add(const Tensor& a, const Tensor& b);
/// Element by element: a - b (f32; the same shape and memory).
Tensor sub(const Tensor& a, const Tensor& b);
/// Element by element: a * b.
Tensor mul(const Tensor& a, const Tensor& b);
/// A copy of `a` (f32) times `s`.
Tensor scale(const Tensor& a, float s);
/// y += alpha * x, in place.
void axpy(float alpha, const Tensor& x, Tensor& y);
/// t *= s, in place.
void scale_in_place(Tensor& t, float s);
/// y(i, j) += row[j] for every row i, in place: a bias.
void add_row(Tensor& y, const Tensor& row);
/// The 1 x N sums of the columns of x (M x N), each summed over i in order.
Tensor column_sums(const Tensor& x);
/// The sum of x's squares (f32 on the host), in double: eight running sums (element i in
/// sum i mod 8) added in a fixed order, then the last size mod 8 in order; the same bits
/// on every CPU, vectorised where it has AVX2 or AVX-512.
double sum_of_squares(const Tensor& x);
/// tanh(x), and dL/dx = dy * (1 - y^2) from y = tanh(x). These four take f16 and bf16
/// too: computed in f32 and rounded once to the input's type.
Tensor tanh(const Tensor& x);
/// dL/dx = dy * (1 - y^2), from y = tanh(x) and dL/dy = dy.
Tensor tanh_backward(const Tensor& y, const Tensor& dy);
/// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3),
/// and its derivative times dy; computed as x sigmoid(2u) = x / (1 + exp(-2u)), the same
/// function with one exp and no 1 + tanh(u) to round (within a few ulp of the tanh form,
/// and 1.4x the GPT's one-device speed: glibc's tanhf costs several expf).
Tensor gelu(const Tensor& x);
/// dL/dx = gelu'(x) * dy, from the input x and dL/dy = dy.
Tensor gelu_backward(const Tensor& x, const Tensor& dy);
/// A copy in another element type. To f16 / bf16: round to nearest even (half.hpp).
Tensor cast(const Tensor& t, DType type);
/// An f32 tensor's values rounded to `type` (f16 or bf16) and kept in f32: what a 16-bit
/// tensor would hold, for arithmetic that then runs in f32 (mixed precision's products,
/// nn::Autocast). `type` f32: `t` itself (of any type), no copy.
Tensor round_to(const Tensor& t, DType type);
/// out[i] = src[index[i]]: rows of src (R x C, any type) picked by an i32/i64 index
/// vector of n entries; out is n x C. An index outside 0..R-1 is an Error.
Tensor index_rows(const Tensor& src, const Tensor& index);
/// dst[index[i]] += src[i] for every row i of src (n x C, f32), in order of i: the
/// inverse of index_rows for gradients, and an MoE layer's combine.
void scatter_add_rows(Tensor& dst, const Tensor& index, const Tensor& src);

// ---------------------------------------------------------------------------
// Comparing (any floating type; the result is a host number)

/// max |a - b| over all elements (the shapes must agree). NaN anywhere gives NaN, and an
/// infinity gives inf or NaN: a comparison `diff <= tolerance` then fails, as it must.
double max_abs_diff(const Tensor& a, const Tensor& b);
/// max |a| over all elements; NaN anywhere gives NaN.
double max_abs(const Tensor& a);
/// True when no element is inf or NaN.
bool all_finite(const Tensor& t);
/// How far two float32 computations of a @ b that sum over k in different orders can
/// differ: 2 * K * u * max over (i, j) of sum_k |a(i,k)| |b(k,j)|, u = 2^-24 (Higham,
/// Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1: each order is within
/// gamma_K = K u / (1 - K u) of the exact sum). Row-parallel results are checked with it.
float matmul_reorder_bound(const Tensor& a, const Tensor& b);

// ---------------------------------------------------------------------------
// Printing

/// How to show shards when printing: split along `dim` into `parts` coloured pieces.
struct ShardView {
  int parts = 1;  ///< The number of shards (1 or less: none).
  int dim = 0;    ///< 0: shards of rows; otherwise of columns (a 1-D tensor's elements).
};
/// How format() prints a tensor.
struct PrintOptions {
  ShardView shards{};  ///< The shards to show.
  int decimals = 3;    ///< Digits after the point (none for integer types).
  bool color = false;  ///< ANSI colours, one per shard; use_color() decides for a stream.
};
/// True when `fd` is a terminal and NO_COLOR is unset.
bool use_color(int fd);
/// Prints `name` (shape) and the values of a 1-D or 2-D tensor, one row per line, shards
/// in colour or, without colour, separated by '|' (columns) or a dashed line (rows).
std::string format(const Tensor& t, const std::string& name, const PrintOptions& options = {});
/// Writes format(t, "tensor").
std::ostream& operator<<(std::ostream& os, const Tensor& t);

// ---------------------------------------------------------------------------

template <Element T>
Tensor Tensor::from_vector(const std::vector<T>& values) {
  Tensor t(Shape{static_cast<std::int64_t>(values.size())}, dtype_of<T>());
  std::span<T> out = t.span<T>();
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = values[i];
  return t;
}

}  // namespace shardlab
