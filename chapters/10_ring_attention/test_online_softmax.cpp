// Chapter 10's exercise tests: merge() against one pass over all the keys, zigzag_chunks()
// against the causal work it must balance (ring_attention.hpp).
//
// References are computed independently of the code under test: the softmax of every
// row over all its keys at once, in double.
//
// Wrong versions this test was checked against, and what each gives:
//   the max not carried (into.max left as it was): "merged twice, then with a third set:
//     out: row 1, head 1 differs: -0.204593, want -1.51518"
//   the denominator rescaled twice (sum = a (a sum1) + b sum2): "attention of the keys in
//     two halves: row 0, head 0 differs: 1.03542, want 1.0208"
//   no guard for two rows that have seen nothing (exp(-inf + inf) = NaN): "an empty row
//     merged with an empty row: not empty" (its sum is NaN)
//   neighbouring chunks 2r and 2r + 1 instead of mirrored ones: "cp 2: rank 1 does
//     2.88235x the work of rank 0"
//   the plain split's one chunk a rank ({r}): "zigzag_chunks(1, 0) = {0}: a rank holds two
//     chunks"
//   the mirrored chunks in decreasing order ({2 cp - 1 - r, r}), though the header
//     promises increasing: "zigzag_chunks(1, 0) = {1, 0}: the header promises increasing
//     order" (CTest ch10.wrong_zigzag_decreasing, CMakeLists.txt: these tests built on it)
//
// The program (main.cpp) linked with a wrong version, as CTests:
//   a merge that normalises inside (out = (a out1 + b out2) / sum): "the attention's
//     output differs from the exact result's by 0.93 (tolerance 1e-05)": the tolerance
//     comes from one device's float result, which runs no merge
//     (ch10.wrong_merge_normalises)
//   a chunk past the end ({r, 2 cp - r}): "zigzag_chunks(4, 0) returned {0, 8}: chunk 8
//     is outside the sequence's chunks 0 to 7", one line and exit 1, where rows_at read
//     past the end (ch10.wrong_chunk_out_of_range)
//   neighbouring chunks, whose results are right: "under the zigzag rank 3 computes
//     6.76x the scores of rank 0: zigzag_chunks must give every rank the same causal
//     work" (ch10.wrong_zigzag_neighbours)
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "ring_attention.hpp"

using namespace ch10;

namespace {

constexpr std::int64_t H = 2, D = 3;

/// n x H D values, twice standard normal: scores spread enough that the max matters.
std::vector<float> random(std::int64_t n, std::uint64_t seed) {
  std::vector<float> out = random_rows(n, H * D, seed);
  for (float& x : out) x *= 2;
  return out;
}

/// softmax(q k^T / sqrt(D)) v of every row and head over `keys` (indices), in double.
std::vector<double> reference(const std::vector<float>& q, const std::vector<float>& k,
                              const std::vector<float>& v, std::int64_t rows,
                              const std::vector<std::int64_t>& keys) {
  std::vector<double> out(static_cast<std::size_t>(rows * H * D), 0.0);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t h = 0; h < H; ++h) {
      std::vector<double> s;
      for (std::int64_t j : keys) {
        double dot = 0;
        for (std::int64_t d = 0; d < D; ++d)
          dot += double(q[i * H * D + h * D + d]) * k[j * H * D + h * D + d];
        s.push_back(dot / std::sqrt(double(D)));
      }
      const double top = *std::max_element(s.begin(), s.end());
      double sum = 0;
      for (double& x : s) sum += x = std::exp(x - top);
      for (std::size_t jj = 0; jj < keys.size(); ++jj)
        for (std::int64_t d = 0; d < D; ++d)
          out[i * H * D + h * D + d] += s[jj] / sum * v[keys[jj] * H * D + h * D + d];
    }
  return out;
}

/// "3, 4"
std::string listed(const std::vector<int>& chunks) {
  std::string out;
  for (int c : chunks) out += (out.empty() ? "" : ", ") + std::to_string(c);
  return out;
}

/// The attention out / sum of a partial.
std::vector<double> normalised(const Partial& p) {
  std::vector<double> out(p.out.size());
  for (std::size_t e = 0; e < out.size(); ++e) out[e] = p.out[e] / p.sum[e / D];
  return out;
}

void check_same(const std::vector<double>& got, const std::vector<double>& want,
                const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t e = 0; e < got.size(); ++e)
    REQUIRE_MESSAGE(std::abs(got[e] - want[e]) <= 1e-5 * (1 + std::abs(want[e])),
                    what << ": row " << e / (H * D) << ", head " << e / D % H
                         << " differs: " << got[e] << ", want " << want[e]);
}

}  // namespace

TEST_CASE("merge: keys in pieces, merged in any order, give one pass over all of them") {
  const std::int64_t rows = 3, keys = 8;
  const auto q = random(rows, 1), k = random(keys, 2), v = random(keys, 3);
  // Every query sees every key (positions: queries after all keys).
  const std::vector<std::int64_t> qpos(rows, keys);
  std::vector<std::int64_t> all(keys);
  for (std::int64_t j = 0; j < keys; ++j) all[static_cast<std::size_t>(j)] = j;
  const std::vector<double> want = reference(q, k, v, rows, all);
  auto part = [&](std::int64_t from, std::int64_t to) {
    std::vector<std::int64_t> pos;
    for (std::int64_t j = from; j < to; ++j) pos.push_back(j);
    const std::vector<float> kk(k.begin() + from * H * D, k.begin() + to * H * D),
        vv(v.begin() + from * H * D, v.begin() + to * H * D);
    return attend(q, kk, vv, qpos, pos, H, D);
  };
  {
    Partial p = part(0, 4);
    merge(p, part(4, 8));
    check_same(normalised(p), want, "attention of the keys in two halves");
  }
  {
    Partial p = part(5, 8);
    merge(p, part(0, 2));
    merge(p, part(2, 5));
    check_same(normalised(p), want, "merged twice, then with a third set: out");
  }
  {
    Partial p = Partial::empty(rows, H, D);
    merge(p, part(0, 8));
    check_same(normalised(p), want, "the empty partial merged with all the keys");
  }
}

TEST_CASE("merge: a row that has seen no key stays empty, and takes what the other saw") {
  Partial a = Partial::empty(1, H, D), b = Partial::empty(1, H, D);
  merge(a, b);
  for (std::size_t r = 0; r < a.max.size(); ++r) {
    CHECK_MESSAGE(a.max[r] == -INFINITY, "an empty row merged with an empty row: not empty");
    CHECK_MESSAGE(a.sum[r] == 0, "an empty row merged with an empty row: not empty");
  }
  for (float x : a.out) CHECK_MESSAGE(x == 0, "an empty row merged with an empty row: not empty");
}

TEST_CASE("zigzag_chunks: two chunks a rank, all 2 cp covered once, equal causal work") {
  for (int cp : {1, 2, 3, 4, 8}) {
    CAPTURE(cp);
    std::set<int> seen;
    std::vector<std::int64_t> work;
    const std::int64_t T = 16 * cp;
    for (int r = 0; r < cp; ++r) {
      const std::vector<int> chunks = zigzag_chunks(cp, r);
      const std::string call = "zigzag_chunks(" + std::to_string(cp) + ", " + std::to_string(r) +
                               ") = {" + listed(chunks) + "}";
      REQUIRE_MESSAGE(chunks.size() == 2, call << ": a rank holds two chunks");
      for (int c : chunks) {
        REQUIRE_MESSAGE((c >= 0 && c < 2 * cp),
                        call << ": chunk " << c << " is outside 0 to " << 2 * cp - 1);
        REQUIRE_MESSAGE(seen.insert(c).second, call << ": chunk " << c << " is held twice");
      }
      REQUIRE_MESSAGE(chunks[0] < chunks[1], call << ": the header promises increasing order");
      // The causal work of its queries: how many keys each position sees.
      std::int64_t w = 0;
      for (std::int64_t p : positions(T, 2 * cp, chunks)) w += p + 1;
      work.push_back(w);
    }
    const auto [lo, hi] = std::minmax_element(work.begin(), work.end());
    CHECK_MESSAGE(*hi == *lo, "cp " << cp << ": rank " << (hi - work.begin()) << " does "
                                    << double(*hi) / double(*lo) << "x the work of rank "
                                    << (lo - work.begin()));
  }
}
