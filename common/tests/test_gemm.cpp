// gemm: every blocked kernel this CPU has gives the plain reference loop's result bit for
// bit, for every shape (tile and block edges), transpose, offset and value (NaN, inf, -0,
// subnormals); row and column halves give the whole product's bits; the reference is one
// fused multiply-add per k in order (checked against std::fma written out), within
// rounding of a double-precision product.
//
// Kernels: avx2 where the CPU has AVX2 + FMA, avx512 where it has AVX-512F, and the avx512
// kernel's tile and blocks (12 x 32, 192 values of k, 144 rows) run in AVX2 registers, so
// that shape's edges are checked on a CPU without AVX-512. A kernel the CPU lacks is named
// as not run.
//
// Wrong versions this suite was checked against (each one failed it; first failure shown):
//   separate multiply and add in the micro-kernel (no FMA)    last bit differs, avx2 1x1x2
//   every k block starting from zero (pc == 0 ignored)          differs, avx2 1x1x385
//   b^T packed with each k block's values reversed              differs, avx2 1x1x2 b^T
//   the accumulator starting at -0.0f instead of +0.0f          a row of -0 x 1 gives -0.0
//   an edge tile that drops its last column                     garbage left, avx2 1x1x1
//   an edge tile storing all MR rows                            the guard past c written
//   transposed b packed ignoring the k block's offset           differs, avx2 1x1x385 b^T
//   transposed a packed as if it were not transposed            differs, avx2 5x1x2 a^T
//   the second row block packed from the first (ic ignored)     row 96 differs, avx2 97x1x1
//   the reference with out += a * b (two roundings)             last bit differs, 1x1x2
//   the 4 x 4 transposes' leftover lines (rows % 4) not copied  differs (a, and b^T)
//   the 4 x 4 transposes' leftover k (kc % 4) stopping one short differs (a, and b^T)

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../src/gemm.hpp"
#include "shardlab/tensor.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::check_equal;

namespace {

/// SplitMix64: the test's values, the same on every platform.
struct Values {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// A float in +-[1, 2) x 2^e, e in -6..6: magnitudes that make every summation order
  /// show in the low bits.
  float number() {
    const std::uint64_t r = next();
    const float mantissa = 1.0f + static_cast<float>(r & 0xffffff) / 16777216.0f;
    const int e = static_cast<int>((r >> 24) % 13) - 6;
    return std::ldexp((r >> 40) & 1 ? -mantissa : mantissa, e);
  }
};

const float inf = std::numeric_limits<float>::infinity();
const float qnan = std::numeric_limits<float>::quiet_NaN();

/// `count` values; with `special`, about one in 300 is NaN, +-inf, +-0, a subnormal, or
/// an extreme normal (so that products overflow and underflow).
std::vector<float> make(std::int64_t count, std::uint64_t seed, bool special = false) {
  const float specials[] = {qnan,   inf,     -inf,  0.0f,   -0.0f,  1e-45f, -3e-42f, 1e-39f,
                            1e-20f, -1e-25f, 3e38f, -2e30f, 1e-38f, -0.0f,  0.0f,    -1.17549e-38f};
  Values v{seed};
  std::vector<float> out(static_cast<std::size_t>(count));
  for (float& x : out) {
    x = v.number();
    if (special && v.next() % 300 == 0) x = specials[v.next() % std::size(specials)];
  }
  return out;
}

bool same(float x, float y) {
  // A NaN result's payload is one NaN operand's, picked by operand position, which a
  // compiler may swap in a commutative add: any NaN equals any NaN. All else: the bits.
  return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y) ||
         (std::isnan(x) && std::isnan(y));
}

/// "" when got and want agree element by element (same()), else the first mismatches.
std::string mismatches(const float* got, const float* want, std::int64_t M, std::int64_t N) {
  std::ostringstream s;
  int shown = 0;
  std::int64_t count = 0;
  for (std::int64_t i = 0; i < M * N; ++i)
    if (!same(got[i], want[i])) {
      if (shown++ < 4)
        s << " (" << i / N << "," << i % N << "): " << got[i] << " vs " << want[i] << " [0x"
          << std::hex << std::bit_cast<std::uint32_t>(got[i]) << " vs 0x"
          << std::bit_cast<std::uint32_t>(want[i]) << std::dec << "]";
      ++count;
    }
  if (count == 0) return "";
  return std::to_string(count) + " of " + std::to_string(M * N) + " differ:" + s.str();
}

/// A kernel under test: its name, how to run it, and its tile and blocks.
struct Candidate {
  std::string name;
  void (*run)(const float*, const float*, float*, std::int64_t, std::int64_t, std::int64_t, bool,
              bool);
  gemm::Blocking shape;
};

template <gemm::Kernel kernel>
void run_kernel(const float* a, const float* b, float* c, std::int64_t M, std::int64_t N,
                std::int64_t K, bool ta, bool tb) {
  gemm::host_matmul_kernel_f32(kernel, a, b, c, M, N, K, ta, tb);
}

/// The blocked kernels this CPU can run (the avx512 shape through AVX2 where it has AVX2).
std::vector<Candidate> candidates() {
  std::vector<Candidate> out;
  if (gemm::kernel_available(gemm::Kernel::avx2)) {
    out.push_back(
        {"avx2", run_kernel<gemm::Kernel::avx2>, gemm::kernel_blocking(gemm::Kernel::avx2)});
    out.push_back({"avx512's shape on avx2", gemm::host_matmul_avx512_shape_on_avx2_f32,
                   gemm::kernel_blocking(gemm::Kernel::avx512)});
  }
  if (gemm::kernel_available(gemm::Kernel::avx512))
    out.push_back(
        {"avx512", run_kernel<gemm::Kernel::avx512>, gemm::kernel_blocking(gemm::Kernel::avx512)});
  return out;
}

/// Runs `kernel` and the reference on the same operands (fresh values from `seed`) and
/// checks every element; the output starts as garbage, which must not matter.
void check_shape(const Candidate& kernel, std::int64_t M, std::int64_t N, std::int64_t K, bool ta,
                 bool tb, std::uint64_t seed, bool special = false) {
  const std::vector<float> a = make(M * K, seed, special), b = make(K * N, seed + 1, special);
  std::vector<float> want(static_cast<std::size_t>(M * N), 12345.0f);
  // Past the output: a guard of more than a tile's rows, which must stay untouched.
  const std::int64_t guard = kernel.shape.tile_rows * N + kernel.shape.tile_cols;
  std::vector<float> got(static_cast<std::size_t>(M * N + guard), qnan);
  std::fill(got.begin() + M * N, got.end(), 777.0f);
  gemm::host_matmul_reference_f32(a.data(), b.data(), want.data(), M, N, K, ta, tb);
  kernel.run(a.data(), b.data(), got.data(), M, N, K, ta, tb);
  const std::string report = mismatches(got.data(), want.data(), M, N);
  const bool guarded =
      std::all_of(got.begin() + M * N, got.end(), [](float x) { return x == 777.0f; });
  const std::string what = kernel.name + ", " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                           std::to_string(K) + (ta ? " a^T" : "") + (tb ? " b^T" : "");
  const bool ok = report.empty() && guarded;
  CHECK_MESSAGE(ok,
                what << ": " << report << std::string(guarded ? "" : " (wrote past the output)"));
}

void check_all_transposes(const Candidate& kernel, std::int64_t M, std::int64_t N, std::int64_t K,
                          std::uint64_t seed, bool special = false) {
  for (int t = 0; t < 4; ++t) check_shape(kernel, M, N, K, t & 1, t & 2, seed + 2 * t, special);
}

/// The definition written out, independently of gemm.cpp: one std::fma per k, in order.
void fma_chain(const float* a, const float* b, float* c, std::int64_t M, std::int64_t N,
               std::int64_t K, bool ta, bool tb) {
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) {
      float sum = 0.0f;
      for (std::int64_t k = 0; k < K; ++k)
        sum = std::fma(ta ? a[k * M + i] : a[i * K + k], tb ? b[j * K + k] : b[k * N + j], sum);
      c[i * N + j] = sum;
    }
}

}  // namespace

TEST_SUITE("gemm") {
  TEST_CASE("each blocked kernel is there exactly when the CPU has its instructions") {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    CHECK(gemm::kernel_available(gemm::Kernel::avx2) == avx2);
    CHECK(gemm::kernel_available(gemm::Kernel::avx512) ==
          (avx2 && bool(__builtin_cpu_supports("avx512f"))));
#endif
    CHECK(gemm::kernel_available(gemm::Kernel::reference));
    std::string run, not_run;
    for (gemm::Kernel k : {gemm::Kernel::avx2, gemm::Kernel::avx512})
      (gemm::kernel_available(k) ? run : not_run) += std::string(" ") + gemm::kernel_name(k);
    MESSAGE("kernels checked here:" << (run.empty() ? " none" : run)
                                    << "; not run (this CPU lacks them):"
                                    << (not_run.empty() ? " none" : not_run) << "; matmul uses "
                                    << gemm::kernel_name(gemm::kernel_in_use()));
    if (std::getenv("SHARDLAB_GEMM") == nullptr) {  // unforced: the fastest there is
      gemm::Kernel best = gemm::Kernel::reference;
      for (gemm::Kernel k : {gemm::Kernel::avx2, gemm::Kernel::avx512})
        if (gemm::kernel_available(k)) best = k;
      CHECK(gemm::kernel_in_use() == best);
    }
  }

  TEST_CASE("every kernel equals the reference bit for bit across tile and block edges") {
    for (const Candidate& kernel : candidates()) {
      const std::int64_t MR = kernel.shape.tile_rows, NR = kernel.shape.tile_cols;
      const std::int64_t KC = kernel.shape.k_block, MC = kernel.shape.row_block;
      const std::int64_t Ms[] = {1, MR - 1, MR, MR + 1, 2 * MR + 1, MC - 1, MC, MC + 1};
      const std::int64_t Ns[] = {1,      NR - 1,     NR,         NR + 1, NR + 7,    2 * NR - 1,
                                 2 * NR, 2 * NR + 1, 4 * NR - 1, 4 * NR, 4 * NR + 1};
      const std::int64_t Ks[] = {1, 2, 7, KC - 1, KC, KC + 1, 2 * KC + 8};
      std::uint64_t seed = 1;
      for (std::int64_t M : Ms)
        for (std::int64_t N : Ns)
          for (std::int64_t K : Ks) check_all_transposes(kernel, M, N, K, seed += 8);
      check_all_transposes(kernel, 1, 1, 1, 100);
      check_all_transposes(kernel, 7, 13, 5, 101);
      check_all_transposes(kernel, 1, 300, 1, 102);    // 1 x N x 1
      check_all_transposes(kernel, 300, 1, 300, 103);  // M x 1 x K
      check_all_transposes(kernel, 1, 1, 1000, 104);
      check_all_transposes(kernel, 5, 7, 0, 105);  // K = 0: zeros
      check_all_transposes(kernel, 0, 7, 5, 106);
      check_all_transposes(kernel, 5, 0, 5, 107);
    }
  }

  TEST_CASE("every kernel equals the reference: squares near 256, the capstone's, column blocks") {
    for (const Candidate& kernel : candidates()) {
      const std::int64_t KC = kernel.shape.k_block, MC = kernel.shape.row_block,
                         NC = kernel.shape.col_block;
      for (std::int64_t M : {255, 257})
        for (std::int64_t N : {255, 256, 257}) check_all_transposes(kernel, M, N, 257, 200 + M + N);
      check_all_transposes(kernel, 256, 256, 256, 210);
      for (std::int64_t N : {128, 384, 512}) check_all_transposes(kernel, 1024, N, 128, 211 + N);
      for (std::int64_t N : {NC - 1, NC, NC + 1, NC + 52})
        check_all_transposes(kernel, 7, N, 3, 220 + N);
      check_all_transposes(kernel, 13, NC + 1, KC + 4, 230);
      check_all_transposes(kernel, 2 * MC + 5, 40, 2 * KC + 1, 231);
    }
  }

  TEST_CASE("NaN, inf, -0 and subnormals come out as the reference's") {
    // Sprinkled among ordinary values, in every shape class above.
    for (const Candidate& kernel : candidates()) {
      const std::int64_t MR = kernel.shape.tile_rows, NR = kernel.shape.tile_cols;
      const std::int64_t KC = kernel.shape.k_block, MC = kernel.shape.row_block;
      std::uint64_t seed = 300;
      for (std::int64_t M : {std::int64_t{1}, MR, MR + 1, MC + 1})
        for (std::int64_t N : {std::int64_t{1}, NR, NR + 1, 2 * NR + 8})
          for (std::int64_t K : {std::int64_t{3}, KC, KC + 44})
            check_all_transposes(kernel, M, N, K, seed += 8, true);
    }

    // By hand. 0 * inf is NaN (zeros are not skipped); +0 + (-0 x 1) is +0 (the sum starts
    // at +0.0f, not at the first product); inf - inf is NaN; subnormal products round.
    const std::int64_t M = 7, N = 17, K = 3;
    std::vector<float> a(M * K, 1.0f), b(K * N, 1.0f);
    a[0 * K + 0] = 0.0f, b[0 * N + 0] = inf;  // out(0, 0) = 0 * inf + 1 + 1
    // Row 1: -0 * 1 three times (and -0 * inf in columns 0 and 16).
    a[1 * K + 0] = -0.0f, a[1 * K + 1] = -0.0f, a[1 * K + 2] = -0.0f;
    b[0 * N + 16] = inf, b[1 * N + 16] = -inf;     // column 16: inf - inf + 1
    a[6 * K + 0] = 1e-30f, b[0 * N + 5] = 1e-15f;  // out(6, 5) = 2^-149 (subnormal) + 0 + 0
    a[6 * K + 1] = 0.0f, a[6 * K + 2] = 0.0f;
    std::vector<Candidate> all = candidates();
    all.insert(all.begin(), {"reference", gemm::host_matmul_reference_f32, {}});
    for (const Candidate& kernel : all) {
      std::vector<float> out(M * N, 5.0f);
      kernel.run(a.data(), b.data(), out.data(), M, N, K, false, false);
      CAPTURE(kernel.name);
      CHECK(std::isnan(out[0 * N + 0]));
      CHECK(out[0 * N + 1] == 2.0f);  // 0 * 1 + 1 + 1
      for (std::int64_t j = 1; j < 16; ++j) CHECK(std::bit_cast<std::uint32_t>(out[N + j]) == 0u);
      CHECK(std::isnan(out[1 * N + 16]));  // -0 * inf too
      CHECK(std::isnan(out[2 * N + 16]));
      CHECK(out[6 * N + 5] == std::ldexp(1.0f, -149));
    }

    // With one NaN payload in play and no inf, the NaN bits themselves agree.
    std::vector<float> x = make(9 * 300, 400), y = make(300 * 20, 401);
    x[5] = qnan, x[2000] = qnan, y[70] = qnan;
    std::vector<float> want(9 * 20), got(9 * 20);
    gemm::host_matmul_reference_f32(x.data(), y.data(), want.data(), 9, 20, 300, false, false);
    for (const Candidate& kernel : candidates()) {
      kernel.run(x.data(), y.data(), got.data(), 9, 20, 300, false, false);
      CHECK_MESSAGE(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0,
                    kernel.name);
    }
  }

  TEST_CASE("the reference is one std::fma per k, in order, from +0") {
    // Against the definition written out here, every element and transpose; and the same
    // loop with a separate multiply and add differs, so this check can tell them apart.
    for (const std::int64_t K : {1, 2, 31, 500}) {
      const std::int64_t M = 9, N = 21;
      const std::vector<float> a = make(M * K, 900 + K, true), b = make(K * N, 901 + K, true);
      for (int t = 0; t < 4; ++t) {
        std::vector<float> want(M * N), got(M * N, qnan);
        fma_chain(a.data(), b.data(), want.data(), M, N, K, t & 1, t & 2);
        gemm::host_matmul_reference_f32(a.data(), b.data(), got.data(), M, N, K, t & 1, t & 2);
        CHECK_MESSAGE(
            mismatches(got.data(), want.data(), M, N).empty(),
            "K " << K << ", transposes " << t << ": " << mismatches(got.data(), want.data(), M, N));
      }
    }
    const std::int64_t M = 16, N = 16, K = 300;
    const std::vector<float> a = make(M * K, 950), b = make(K * N, 951);
    std::vector<float> fused(M * N), separate(M * N);
    fma_chain(a.data(), b.data(), fused.data(), M, N, K, false, false);
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) {
        float sum = 0.0f;
        for (std::int64_t k = 0; k < K; ++k) {
          const volatile float product = a[i * K + k] * b[k * N + j];  // rounded on its own
          sum += product;
        }
        separate[i * N + j] = sum;
      }
    CHECK_FALSE(mismatches(separate.data(), fused.data(), M, N).empty());
  }

  TEST_CASE("matmul on views at odd offsets equals matmul_reference and writes only its output") {
    const std::int64_t M = 37, N = 29, K = 397;  // past avx2's k block of 384
    const Tensor storage = randn(1, 3 + M * K + 5 + K * N, 7);
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const Tensor a = storage.view(3, ta ? Shape{K, M} : Shape{M, K});
      const Tensor b = storage.view(3 + M * K + 5, tb ? Shape{N, K} : Shape{K, N});
      Tensor buffer = full(1, 1 + M * N + 1, -7.0f);
      Tensor out = buffer.view(1, Shape{M, N});  // 4 bytes past an allocation's alignment
      matmul_into(out, a, b, ta, tb);
      CAPTURE(t);
      check_equal(out, matmul_reference(a, b, ta, tb), "matmul vs matmul_reference");
      check_equal(matmul(a, b, ta, tb), matmul_reference(a, b, ta, tb), "matmul");
      CHECK(buffer[0] == -7.0f);
      CHECK(buffer[1 + M * N] == -7.0f);
    }
    Tensor wrong(3, 3);
    CHECK_THROWS_AS(matmul_reference_into(wrong, Tensor(3, 4), Tensor(4, 2)), Error);
    CHECK_THROWS_AS(matmul_reference(Tensor(3, 4), Tensor(3, 2)), Error);
  }

  TEST_CASE("rows and columns split in two give the whole product's bits") {
    for (std::int64_t M : {2, 13, 150, 301}) {
      const std::int64_t K = 400, N = 47;  // two k blocks in every kernel
      const Tensor a = randn(M, K, 10 + M), b = randn(K, N, 20 + M);
      const Tensor whole = matmul(a, b);
      for (std::int64_t top : {std::int64_t{1}, M / 2, M - 1}) {
        const Tensor rows =
            concat({matmul(a.slice(0, top), b), matmul(a.slice(top, M - top), b)}, 0);
        check_equal(rows, whole, "row halves, top " + std::to_string(top));
      }
      const std::vector<Tensor> columns = split(b, 2, 1);
      check_equal(concat({matmul(a, columns[0]), matmul(a, columns[1])}, 1), whole,
                  "column halves");
      // The transposed forms of the same product: a^T stored, b^T stored, both.
      check_equal(matmul(transpose(a), b, true, false), whole, "a^T");
      check_equal(matmul(a, transpose(b), false, true), whole, "b^T");
      check_equal(matmul(transpose(a), transpose(b), true, true), whole, "a^T b^T");
    }
  }

  TEST_CASE("the reference is within gamma_K of a double-precision product") {
    const std::int64_t M = 19, N = 23, K = 700;
    const Tensor a = randn(M, K, 30), b = randn(K, N, 31);
    const Tensor c = matmul_reference(a, b);
    const double u = std::ldexp(1.0, -24), gamma = K * u / (1 - K * u);
    double worst = 0;
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) {
        double exact = 0, magnitude = 0;
        for (std::int64_t k = 0; k < K; ++k) {
          exact += double(a(i, k)) * double(b(k, j));
          magnitude += std::fabs(double(a(i, k)) * double(b(k, j)));
        }
        const double err = std::fabs(double(c(i, j)) - exact);
        CHECK(err <= gamma * magnitude);
        worst = std::max(worst, err / (gamma * magnitude));
      }
    MESSAGE("worst error: " << worst << " of the bound");
    CHECK(worst > 0);  // rounding is there: the reference sums in f32, not in double
  }

  TEST_CASE("ranks as threads: concurrent matmuls each give the reference's bits") {
    for (const Candidate& kernel : candidates()) {
      std::vector<std::string> reports(4);
      std::vector<std::thread> threads;
      for (int r = 0; r < 4; ++r)
        threads.emplace_back([r, &reports, &kernel] {
          const std::int64_t M = 100 + 7 * r, N = 90 + 5 * r, K = kernel.shape.k_block + 20 + r;
          const std::vector<float> a = make(M * K, 500 + r), b = make(K * N, 600 + r);
          std::vector<float> want(M * N), got(M * N);
          gemm::host_matmul_reference_f32(a.data(), b.data(), want.data(), M, N, K, r & 1, r & 2);
          for (int rep = 0; rep < 3; ++rep) {
            kernel.run(a.data(), b.data(), got.data(), M, N, K, r & 1, r & 2);
            reports[r] += mismatches(got.data(), want.data(), M, N);
          }
        });
      for (std::thread& t : threads) t.join();
      for (int r = 0; r < 4; ++r)
        CHECK_MESSAGE(reports[r].empty(), kernel.name << ", thread " << r << ": " << reports[r]);
    }
  }
}
