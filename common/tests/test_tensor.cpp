// Tensor: views that share memory, shards, joins, element types and casts, the matmul's
// summation order, gather/scatter by index, the generator, printing.
//
// Wrong versions this suite was checked against: a slice that copies instead of viewing
// (views share memory); shard along dim 1 taking the wrong column offset (split/concat
// round trip); index_rows reading row i instead of row index[i], scatter_add_rows
// overwriting instead of adding (gather and scatter-add); max_abs_diff dropping NaN
// (NaN never compares equal); a freed block handed back without zeroing it, no cache at
// all, a cache that keeps blocks past its capacity; sum_of_squares summed in order (one
// running sum), its last size mod 8 elements dropped, its eight sums added s0 + s1 + ... +
// s7, every term into the first sum, its squares taken in float (each: "sum_of_squares(n = ...)"
// with the two sums).
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>

#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/half.hpp"
#include "shardlab/results.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::check_equal;

TEST_SUITE("tensor") {
  TEST_CASE("shard_range gives the first size % parts shards one element more") {
    // 10 over 4: 3 3 2 2
    CHECK(shard_range(10, 4, 0).offset == 0);
    CHECK(shard_range(10, 4, 0).length == 3);
    CHECK(shard_range(10, 4, 1).offset == 3);
    CHECK(shard_range(10, 4, 2).offset == 6);
    CHECK(shard_range(10, 4, 2).length == 2);
    CHECK(shard_range(10, 4, 3).offset == 8);
    // More parts than elements: trailing parts are empty.
    CHECK(shard_range(2, 3, 2).length == 0);
    CHECK(shard_range(2, 3, 2).offset == 2);
    CHECK(shard_counts(10, 4, 5) == std::vector<std::size_t>{15, 15, 10, 10});
    CHECK_THROWS_AS(shard_range(5, 0, 0), Error);
  }

  TEST_CASE("views share memory and never copy: slice, view, reshape, flat, shard along dim 0") {
    Tensor flat_buffer = arange(12);
    Tensor rows = flat_buffer.reshape(Shape{4, 3});
    Tensor middle = rows.slice(1, 2);  // rows 1 and 2
    CHECK(middle.shape() == Shape{2, 3});
    CHECK(middle.shares_memory_with(flat_buffer));
    CHECK(middle(0, 0) == 3.0f);
    middle(1, 2) = -1.0f;  // row 2, column 2 of rows = element 8 of the buffer
    CHECK(flat_buffer[8] == -1.0f);
    Tensor param = flat_buffer.view(5, Shape{1, 3});  // a parameter inside one allocation
    param.fill(7.0);
    CHECK(flat_buffer[5] == 7.0f);
    CHECK(flat_buffer[7] == 7.0f);
    CHECK(flat_buffer[8] == -1.0f);
    CHECK(shard(rows, 2, 0, 1).shares_memory_with(flat_buffer));
    CHECK_FALSE(shard(rows, 2, 1, 1).shares_memory_with(flat_buffer));  // columns: a copy
    Tensor copy = rows.clone();
    copy(0, 0) = 100.0f;
    CHECK(rows(0, 0) == 0.0f);
    CHECK_THROWS_AS(flat_buffer.view(10, Shape{3}), Error);
    CHECK_THROWS_AS(rows.slice(3, 2), Error);
    CHECK_THROWS_AS(rows.reshape(Shape{5, 2}), Error);
  }

  TEST_CASE("split then concat gives back the tensor, along any dim, for every part count") {
    const Tensor t = randn(Shape{5, 7, 3}, 42);
    for (int parts : {1, 2, 3, 4, 8}) {
      CAPTURE(parts);
      for (int dim : {0, 1, 2}) {
        CAPTURE(dim);
        const std::vector<Tensor> pieces = split(t, parts, dim);
        REQUIRE(pieces.size() == static_cast<std::size_t>(parts));
        CHECK(pieces[0].dim(dim) == shard_range(t.dim(dim), parts, 0).length);
        check_equal(concat(pieces, dim), t, "concat(split(t))");
      }
    }
    // Element by element: column shard p holds columns offset..offset+length of every row.
    const Tensor m = randn(4, 7, 3);
    for (int p = 0; p < 3; ++p) {
      const Tensor s = shard(m, 3, 1, p);
      const ShardRange range = shard_range(7, 3, p);
      for (std::int64_t i = 0; i < 4; ++i)
        for (std::int64_t j = 0; j < range.length; ++j) REQUIRE(s(i, j) == m(i, range.offset + j));
    }
    const Tensor v = arange(10);
    check_equal(concat(split(v, 3, 0), 0), v, "1-D round trip");
  }

  TEST_CASE("element types: zeros, fill, arange and exact casts for every type") {
    for (DType type :
         {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::u8}) {
      CAPTURE(dtype_name(type));
      Tensor t(Shape{2, 3}, type);
      CHECK(t.bytes() == 6 * dtype_size(type));
      CHECK(max_abs(cast(t, DType::f64)) == 0.0);
      t.fill(5.0);
      const Tensor back = cast(t, DType::f32);
      for (float v : back) CHECK(v == 5.0f);
      check_equal(cast(cast(arange(20), type), DType::f32), arange(20), "integers survive casts");
    }
    Tensor ids = Tensor::from_vector<std::int32_t>({3, 1, 4});
    CHECK(ids.dtype() == DType::i32);
    CHECK(ids.data<std::int32_t>()[2] == 4);
    CHECK_THROWS_AS(ids.data<float>(), Error);  // the wrong element type is an error
    CHECK_THROWS_AS((void)ids[0], Error);       // so is f32 access to an i32 tensor
  }

  TEST_CASE("casts to f16 and bf16 round to nearest even, as half.hpp does") {
    const Tensor x = scale(randn(1, 1000, 5), 300.0f);
    for (DType type : {DType::f16, DType::bf16}) {
      const Tensor h = cast(x, type);
      const std::uint16_t* bits = static_cast<const std::uint16_t*>(h.raw());
      for (std::int64_t i = 0; i < x.size(); ++i)
        REQUIRE(bits[i] ==
                (type == DType::f16 ? float_to_half_bits(x[i]) : float_to_bf16_bits(x[i])));
    }
    const Tensor big = Tensor::from_1d({70000.0f});
    CHECK_FALSE(all_finite(cast(big, DType::f16)));  // fp16's max is 65504
    CHECK(all_finite(cast(big, DType::bf16)));
  }

  TEST_CASE("matmul matches hand-computed values, transposed operands included") {
    const Tensor a = Tensor::from({{1, 2}, {3, 4}, {5, 6}});
    const Tensor b = Tensor::from({{1, 0, 2}, {0, 1, 3}});
    const Tensor ab = Tensor::from({{1, 2, 8}, {3, 4, 18}, {5, 6, 28}});
    check_equal(matmul(a, b), ab, "a @ b");
    check_equal(matmul(transpose(a), b, true, false), ab, "(a^T)^T @ b");
    check_equal(matmul(a, transpose(b), false, true), ab, "a @ (b^T)^T");
    check_equal(matmul(transpose(a), transpose(b), true, true), ab, "both transposed");
    CHECK_THROWS_AS(matmul(a, a), Error);
    // f16 inputs: exact small integers, accumulated in f32, rounded once.
    check_equal(cast(matmul(cast(a, DType::f16), cast(b, DType::f16)), DType::f32), ab, "f16");
  }

  TEST_CASE("matmul of a row or column shard is bitwise the matching shard of the full product") {
    const Tensor x = randn(6, 33, 1), w = randn(33, 10, 2);
    const Tensor out = matmul(x, w);
    for (int parts : {2, 3, 4}) {
      for (int p = 0; p < parts; ++p) {
        check_equal(matmul(shard(x, parts, 0, p), w), shard(out, parts, 0, p), "row shard");
        check_equal(matmul(x, shard(w, parts, 1, p)), shard(out, parts, 1, p), "column shard");
      }
    }
  }

  TEST_CASE("elementwise ops, bias rows, column sums and diffs") {
    const Tensor a = Tensor::from({{1, 2}, {3, 4}}), b = full(2, 2, 0.5f);
    check_equal(add(a, b), Tensor::from({{1.5f, 2.5f}, {3.5f, 4.5f}}), "add");
    check_equal(sub(a, b), Tensor::from({{0.5f, 1.5f}, {2.5f, 3.5f}}), "sub");
    check_equal(mul(a, b), Tensor::from({{0.5f, 1.0f}, {1.5f, 2.0f}}), "mul");
    check_equal(scale(a, 2), Tensor::from({{2, 4}, {6, 8}}), "scale");
    Tensor y = a.clone();
    axpy(-2.0f, b, y);
    check_equal(y, Tensor::from({{0, 1}, {2, 3}}), "axpy");
    Tensor z = a.clone();
    add_row(z, Tensor::from({{10, 20}}));
    check_equal(z, Tensor::from({{11, 22}, {13, 24}}), "add_row");
    check_equal(column_sums(a), Tensor::from({{4, 6}}), "column_sums");
    CHECK(max_abs_diff(a, y) == 1.0);
    CHECK(max_abs(a) == 4.0);
    check_equal(transpose(Tensor::from({{1, 2, 3}})), Tensor::from({{1}, {2}, {3}}), "transpose");
    CHECK_THROWS_AS(add(a, zeros(1, 2)), Error);
  }

  TEST_CASE("sum_of_squares: eight running sums in double, in its order, the tail after") {
    // The order written out here, in plain double arithmetic (this file is built for any
    // x86-64, the library's loop for this CPU's widest vectors).
    auto by_definition = [](const Tensor& x) {
      const float* p = x.data();
      const std::int64_t n = x.size(), whole = n / 8 * 8;
      double s[8] = {};
      for (std::int64_t i = 0; i < whole; ++i) s[i % 8] += static_cast<double>(p[i]) * p[i];
      double sum = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
      for (std::int64_t i = whole; i < n; ++i) sum += static_cast<double>(p[i]) * p[i];
      return sum;
    };
    bool order_shows = false;  // the data tell one order from another
    for (std::int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 63, 1000, 4099}) {
      // Values spread over nine decades, so that the order of the additions shows.
      Tensor x = randn(Shape{n}, 11 + static_cast<std::uint64_t>(n));
      for (std::int64_t i = 0; i < n; ++i) x.data()[i] *= std::pow(10.0f, float(i % 9) - 4);
      double in_order = 0;
      for (float v : x.span()) in_order += static_cast<double>(v) * v;
      order_shows = order_shows || in_order != by_definition(x);
      const double got = sum_of_squares(x), want = by_definition(x);
      CHECK_MESSAGE(got == want,
                    "sum_of_squares(n = " << n << "): " << got << ", its order gives " << want);
      if (n > 1)  // a shard starting anywhere: the same definition over its own elements
        CHECK(sum_of_squares(x.slice(1, n - 1)) == by_definition(x.slice(1, n - 1)));
    }
    CHECK_MESSAGE(order_shows, "the data do not tell the sums' order from summing in order");
    CHECK_THROWS_AS(sum_of_squares(zeros(Shape{2}, DType::f16)), Error);
  }

  TEST_CASE("NaN and infinity never compare equal: max_abs_diff, max_abs, all_finite") {
    Tensor a = Tensor::from_1d({1, 2, 3}), b = a.clone();
    b[1] = std::numeric_limits<float>::quiet_NaN();
    CHECK(std::isnan(max_abs_diff(a, b)));
    CHECK(std::isnan(max_abs(b)));
    CHECK_FALSE(all_finite(b));
    b[1] = std::numeric_limits<float>::infinity();
    CHECK_FALSE(max_abs_diff(a, b) <= 1e30);
    CHECK_FALSE(all_finite(b));
    CHECK(all_finite(a));
  }

  TEST_CASE("tanh and GELU match their formulas; their backwards match central differences") {
    const Tensor x = Tensor::from_1d({-3.0f, -0.5f, 0.0f, 0.25f, 2.0f});
    const Tensor g = gelu(x), t = tanh(x);
    const Tensor ones = full(Shape{5}, 1.0f);
    const Tensor dgelu = gelu_backward(x, ones), dtanh = tanh_backward(t, ones);
    for (std::int64_t i = 0; i < 5; ++i) {
      const double v = x[i];
      const double want =
          0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
      CHECK(g[i] == doctest::Approx(want).epsilon(1e-6));
      CHECK(t[i] == doctest::Approx(std::tanh(v)).epsilon(1e-6));
      const double h = 1e-3;
      auto gelu_at = [](double u) {
        return 0.5 * u * (1 + std::tanh(0.7978845608028654 * (u + 0.044715 * u * u * u)));
      };
      CHECK(dgelu[i] == doctest::Approx((gelu_at(v + h) - gelu_at(v - h)) / (2 * h)).epsilon(1e-4));
      CHECK(dtanh[i] ==
            doctest::Approx((std::tanh(v + h) - std::tanh(v - h)) / (2 * h)).epsilon(1e-4));
    }
  }

  TEST_CASE("index_rows picks rows by index; scatter_add_rows adds them back, repeats included") {
    const Tensor table = Tensor::from({{0, 1}, {10, 11}, {20, 21}, {30, 31}});
    for (DType index_type : {DType::i32, DType::i64}) {
      CAPTURE(dtype_name(index_type));
      const Tensor index = cast(Tensor::from_vector<std::int64_t>({2, 0, 2, 3}), index_type);
      const Tensor rows = index_rows(table, index);
      check_equal(rows, Tensor::from({{20, 21}, {0, 1}, {20, 21}, {30, 31}}), "index_rows");
      Tensor into(4, 2);
      scatter_add_rows(into, index, Tensor::from({{1, 2}, {3, 4}, {5, 6}, {7, 8}}));
      // Row 2 gets rows 0 and 2 of src added; row 1 nothing.
      check_equal(into, Tensor::from({{3, 4}, {0, 0}, {6, 8}, {7, 8}}), "scatter_add_rows");
      const Tensor bad = cast(Tensor::from_vector<std::int64_t>({1, 4}), index_type);
      CHECK_THROWS_WITH_AS(index_rows(table, bad), doctest::Contains("index[1] = 4"), Error);
      CHECK_THROWS_AS(scatter_add_rows(into, bad, zeros(2, 2)), Error);
    }
    // Any element type gathers: ids of an f16 table.
    const Tensor halves = cast(table, DType::f16);
    check_equal(cast(index_rows(halves, Tensor::from_vector<std::int32_t>({3})), DType::f32),
                Tensor::from({{30, 31}}), "gather of f16 rows");
  }

  TEST_CASE("randn is reproducible, seed-dependent, and roughly standard normal") {
    CHECK(randn(3, 3, 7).bitwise_equal(randn(3, 3, 7)));
    CHECK_FALSE(randn(3, 3, 7).bitwise_equal(randn(3, 3, 8)));
    const Tensor big = randn(200, 500, 1);
    double mean = 0, var = 0;
    for (float v : big) mean += v;
    mean /= static_cast<double>(big.size());
    for (float v : big) var += (v - mean) * (v - mean);
    var /= static_cast<double>(big.size());
    CHECK(std::abs(mean) < 0.01);
    CHECK(var == doctest::Approx(1.0).epsilon(0.01));
  }

  TEST_CASE("format shows shards with separators when plain and colours on a terminal") {
    const Tensor t = Tensor::from({{1, 2, 3, 4}, {5, 6, 7, 8}});
    const std::string cols = format(t, "w", {{2, 1}, 1, false});
    CHECK(cols.find("w (2x4, 2 shards along dim 1)") != std::string::npos);
    CHECK(cols.find("2.0 |") != std::string::npos);
    const std::string rows = format(t, "x", {{2, 0}, 1, false});
    CHECK(rows.find("---") != std::string::npos);
    const std::string colored = format(t, "x", {{2, 0}, 1, true});
    CHECK(colored.find("\033[34m") != std::string::npos);
    CHECK(colored.find("\033[31m") != std::string::npos);
    CHECK(format(Tensor::from_vector<std::int32_t>({7, 8}), "ids").find("ids ([2], i32)") !=
          std::string::npos);
  }
}

TEST_CASE("freed host storage is taken back by the next tensor of its size, zeroed again") {
  // Under AddressSanitizer there is no cache: every storage comes from the system.
#if defined(SHARDLAB_ASAN_BUILD)
  const std::uint64_t no_cache = 1;
#else
  const std::uint64_t no_cache = 0;
#endif
  const std::uint64_t before = host_storage_allocations();
  const float* first = nullptr;
  {
    Tensor t(77777);  // a size no other test makes, so no block of it is cached yet
    t.fill(7.0f);
    first = t.data();
  }
  CHECK(host_storage_allocations() == before + 1);
  Tensor again(77777);  // the same size: the block just freed
  CHECK_MESSAGE(host_storage_allocations() == before + 1 + no_cache,
                "a tensor of a freed block's size went to the system allocator");
  if (!no_cache) CHECK(again.data() == first);
  std::int64_t nonzero = 0;
  for (std::int64_t i = 0; i < again.shape().numel(); ++i) nonzero += again.data()[i] != 0.0f;
  CHECK_MESSAGE(nonzero == 0, nonzero << " elements of a reused block were not zeroed");
  Tensor other(77778);  // another size takes a block of its own
  CHECK_MESSAGE(host_storage_allocations() == before + 2 + no_cache,
                "a tensor was given a block of another size");
  // A block larger than the cache's capacity (64 MiB) goes back to the system.
  const std::int64_t huge = (std::int64_t{64} << 20) / 4 + 1;
  { Tensor big(huge); }
  { Tensor big(huge); }
  CHECK_MESSAGE(host_storage_allocations() == before + 4 + no_cache,
                "a block past the cache's capacity was kept");
}

TEST_CASE("tanh, gelu and their backward take f16 and bf16: computed in f32, rounded once") {
  // Checked against: a half input computed without rounding back (an f32 result), and
  // one rounded twice (through bf16 for an f16 input): both fail here.
  const Tensor x32 = randn(Shape{3, 37}, 21), dy32 = randn(Shape{3, 37}, 22);
  for (DType type : {DType::f16, DType::bf16}) {
    CAPTURE(dtype_name(type));
    const Tensor x = cast(x32, type), dy = cast(dy32, type);
    const Tensor wide = cast(x, DType::f32), dwide = cast(dy, DType::f32);
    CHECK(tanh(x).dtype() == type);
    CHECK(tanh(x).bitwise_equal(cast(tanh(wide), type)));
    CHECK(gelu(x).bitwise_equal(cast(gelu(wide), type)));
    CHECK(tanh_backward(x, dy).bitwise_equal(cast(tanh_backward(wide, dwide), type)));
    CHECK(gelu_backward(x, dy).bitwise_equal(cast(gelu_backward(wide, dwide), type)));
  }
}

// When the GPU tests may skip: only where there is no GPU. Wrong versions this was checked
// against: every CUDA error read as "no device" (a too-old driver then skips every GPU test);
// nvidiactl or nvidia-uvm taken for a GPU (containers without one have them); the world rank
// picking the GPU under mpirun (a second node's ranks ask for GPUs 4-7 of a 4-GPU node).
TEST_SUITE("cuda probe") {
  TEST_CASE("no GPU skips; a GPU that CUDA cannot start is an error that says what to do") {
    namespace fs = std::filesystem;
    const fs::path dev = fs::temp_directory_path() / ("shardlab_dev_" + std::to_string(::getpid()));
    fs::remove_all(dev);
    fs::create_directories(dev);
    std::ofstream(dev / "nvidiactl") << "";
    std::ofstream(dev / "nvidia-uvm") << "";
    CHECK(cuda::gpu_device_node(dev.string()).empty());
    CHECK(cuda::start_failure(35, "cudaErrorInsufficientDriver", dev.string()).empty());
    std::ofstream(dev / "nvidia0") << "";
    CHECK(cuda::gpu_device_node(dev.string()) == (dev / "nvidia0").string());
    const std::string old_driver =
        cuda::start_failure(35, "cudaErrorInsufficientDriver", dev.string());
    CHECK(old_driver.find("GPU is present") != std::string::npos);
    CHECK(old_driver.find("r580") != std::string::npos);
    CHECK(old_driver.find("error 35") != std::string::npos);
    const std::string other = cuda::start_failure(2, "cudaErrorMemoryAllocation", dev.string());
    CHECK(other.find("protect_shadow_gap=0") != std::string::npos);
    // cudaErrorNoDevice is "no GPU" whatever the device nodes say.
    CHECK(cuda::start_failure(100, "cudaErrorNoDevice", dev.string()).empty());
    fs::remove_all(dev);
  }

  TEST_CASE("under a launcher a process's GPU follows its local rank, not its world rank") {
    ::unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
    ::unsetenv("MPI_LOCALRANKID");
    ::unsetenv("SLURM_LOCALID");
    CHECK(cuda::local_rank(5) == 5);
    ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
    CHECK(cuda::local_rank(5) == 1);
    ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "x", 1);  // not a number: the rank itself
    CHECK(cuda::local_rank(5) == 5);
    ::unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
    ::setenv("SLURM_LOCALID", "3", 1);
    CHECK(cuda::local_rank(7) == 3);
    ::unsetenv("SLURM_LOCALID");
  }
}
