// Tensor: shards, joins, the matmul's summation order, the generator, printing.
#include <doctest/doctest.h>

#include "shardlab/check.hpp"
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
    CHECK_THROWS_AS(shard_range(5, 0, 0), UsageError);
  }

  TEST_CASE("split then concat gives back the tensor, along either dim, for every part count") {
    const Tensor t = randn(5, 7, 42);
    for (int parts : {1, 2, 3, 4, 8}) {
      CAPTURE(parts);
      for (int dim : {0, 1}) {
        CAPTURE(dim);
        const std::vector<Tensor> pieces = split(t, parts, dim);
        REQUIRE(pieces.size() == static_cast<std::size_t>(parts));
        CHECK(pieces[0].dim(dim) == shard_range(t.dim(dim), parts, 0).length);
        check_equal(concat(pieces, dim), t, "concat(split(t))");
        check_equal(shard(t, parts, dim, parts - 1), pieces.back(), "shard == split's last");
      }
    }
    const Tensor v = arange(10);
    check_equal(concat(split(v, 3, 0), 0), v, "1-D round trip");
  }

  TEST_CASE("matmul matches hand-computed values") {
    const Tensor a = Tensor::from({{1, 2}, {3, 4}, {5, 6}});
    const Tensor b = Tensor::from({{1, 0, 2}, {0, 1, 3}});
    check_equal(matmul(a, b), Tensor::from({{1, 2, 8}, {3, 4, 18}, {5, 6, 28}}), "a @ b");
    CHECK_THROWS_AS(matmul(a, a), UsageError);
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

  TEST_CASE("elementwise ops and diffs") {
    const Tensor a = Tensor::from({{1, 2}, {3, 4}}), b = full(2, 2, 0.5f);
    check_equal(add(a, b), Tensor::from({{1.5f, 2.5f}, {3.5f, 4.5f}}), "add");
    check_equal(sub(a, b), Tensor::from({{0.5f, 1.5f}, {2.5f, 3.5f}}), "sub");
    check_equal(scale(a, 2), Tensor::from({{2, 4}, {6, 8}}), "scale");
    Tensor y = a;
    axpy(-2.0f, b, y);
    check_equal(y, Tensor::from({{0, 1}, {2, 3}}), "axpy");
    CHECK(max_abs_diff(a, y) == 1.0f);
    CHECK(max_abs(a) == 4.0f);
    check_equal(transpose(Tensor::from({{1, 2, 3}})), Tensor::from({{1}, {2}, {3}}), "transpose");
    CHECK_THROWS_AS(add(a, zeros(1, 2)), UsageError);
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
  }

  TEST_CASE("CSV tables quote what needs quoting and refuse ragged rows") {
    CsvTable table({"name", "value"});
    table.add({"a,b", "1"});
    table.add({"say \"hi\"", format_number(0.5)});
    CHECK(table.str() == "name,value\n\"a,b\",1\n\"say \"\"hi\"\"\",0.5\n");
    CHECK_THROWS(table.add({"only one"}));
  }
}
