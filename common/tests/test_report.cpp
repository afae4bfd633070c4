// The report side of the library: one Table rendered three ways, numbers with units from
// the command line, the toy model and its teacher, and the replica check.
//
// Wrong versions these tests were checked against (each failed here, then was undone):
//   - Table::json writing every cell as a string ("bytes": "512" instead of 512)
//   - Table::text dropping the last row (the loop bound one short)
//   - parse_quantity's binary M as 1e6 (64M read as 64000000 bytes)
//   - parse_quantity treating a subnormal (1e-310) as "not a number" (stod's ERANGE)
//   - toy::mlp seeding layer l from l alone (a slice then differs from the whole model:
//     seeds must depend on the model's seed too, and the slice must equal the whole)
//   - replica_divergence comparing each rank with itself (always 0)
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "shardlab/cli.hpp"
#include "shardlab/comm.hpp"
#include "shardlab/results.hpp"
#include "shardlab/testing.hpp"
#include "shardlab/toy.hpp"

using namespace shardlab;

TEST_CASE("a Table renders the same rows as text, CSV and JSON") {
  Table t({"stage", "bytes", "ratio", "ok"});
  t.add({"zero-1", std::uint64_t{917504}, 0.4375, true});
  t.add({"zero-3, sharded", 524288, 0.25, false});
  CHECK(t.rows() == 2);
  CHECK(t.csv() ==
        "stage,bytes,ratio,ok\nzero-1,917504,0.4375,true\n\"zero-3, sharded\",524288,0.25,false\n");
  const std::string text = t.text();
  CHECK(text ==
        "  stage             bytes   ratio     ok\n"
        "  zero-1           917504  0.4375   true\n"
        "  zero-3, sharded  524288    0.25  false\n");
  const nlohmann::json j = t.json();
  REQUIRE(j.is_array());
  REQUIRE(j.size() == 2);
  CHECK(j[0]["stage"] == "zero-1");
  CHECK(j[0]["bytes"].is_number_integer());
  CHECK(j[0]["bytes"] == 917504);
  CHECK(j[1]["ratio"] == 0.25);
  CHECK(j[1]["ok"] == false);
  CHECK_THROWS(t.add({"too", "few"}));
}

TEST_CASE("a Table's CSV quotes what needs quoting") {
  Table table({"name", "value"});
  table.add({"a,b", "1"});
  table.add({"say \"hi\"", format_number(0.5)});
  CHECK(table.str() == "name,value\n\"a,b\",1\n\"say \"\"hi\"\"\",0.5\n");
}

TEST_CASE("numbers with units read as papers write them") {
  using cli::parse_quantity;
  using cli::Units;
  CHECK(parse_quantity("7.5B") == 7.5e9);
  CHECK(parse_quantity("350M") == 350e6);
  CHECK(parse_quantity("1T") == 1e12);
  CHECK(parse_quantity("64K") == 64e3);
  CHECK(parse_quantity("2^16") == 65536);
  CHECK(parse_quantity("2^-24") == std::ldexp(1.0, -24));
  CHECK(parse_quantity("1e-3") == 1e-3);
  CHECK(parse_quantity("64M", Units::binary) == 64.0 * 1024 * 1024);
  CHECK(parse_quantity("4K", Units::binary) == 4096);
  CHECK(parse_quantity("1G", Units::binary) == 1024.0 * 1024 * 1024);
  CHECK(parse_quantity("1e-310") == 1e-310);  // subnormal: a number like any other
  CHECK(parse_quantity("4.9e-324") > 0);
  for (const char* bad : {"", "abc", "7.5X", "2^", "2^1.5", "1e999", "2^5000", "--3"})
    CHECK_THROWS_AS(parse_quantity(bad), std::invalid_argument);
  CHECK_THROWS_AS(parse_quantity("3B", Units::binary), std::invalid_argument);
  try {
    (void)parse_quantity("1e999");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("too large") != std::string::npos);
  }
  // The transform hands CLI11 a plain number: whole numbers stay whole.
  std::string text = "2^16";
  CHECK(cli::quantity()(text).empty());
  CHECK(text == "65536");
  text = "7.5X";
  CHECK(!cli::quantity()(text).empty());
  std::string tiny = "1e-310";
  CHECK(cli::between(0.0, 1.0)(tiny).empty());
  std::string huge = "1e999";
  CHECK(cli::between(0.0, 1.0)(huge).find("too large") != std::string::npos);
}

TEST_CASE("toy::mlp: any slice of the model has the whole model's weights") {
  const toy::MlpConfig config{.widths = {6, 5, 5, 3}, .seed = 7};
  nn::ParameterStore whole_store, first_store, rest_store;
  nn::Sequential whole = toy::mlp(whole_store, config);
  nn::Sequential first = toy::mlp(first_store, config, 0, 1);
  nn::Sequential rest = toy::mlp(rest_store, config, 1, 3);
  whole_store.allocate();
  first_store.allocate();
  rest_store.allocate();
  CHECK(whole.size() == 5);  // Linear tanh Linear tanh Linear
  CHECK(first.size() == 2);
  CHECK(rest.size() == 3);
  const Tensor x = randn(4, 6, 3);
  const Tensor y_whole = whole.forward(x).out;
  const Tensor y_split = rest.forward(first.forward(x).out).out;
  CHECK(y_whole.bitwise_equal(y_split));
  CHECK(y_whole.cols() == 3);
  // Another seed, other weights.
  nn::ParameterStore other_store;
  nn::Sequential other = toy::mlp(other_store, {.widths = {6, 5, 5, 3}, .seed = 8});
  other_store.allocate();
  CHECK(max_abs_diff(other.forward(x).out, y_whole) > 0);
  CHECK_THROWS(toy::mlp(other_store, config, 2, 4));
}

TEST_CASE("toy::Teacher: the same batch for a step everywhere, a new one each step") {
  const toy::MlpConfig shape{.widths = {4, 8, 2}, .seed = 1};
  const toy::Teacher a(shape, 5), b(shape, 5), scaled(shape, 5, 0.5);
  const toy::Batch a0 = a.batch(16, 0), b0 = b.batch(16, 0), a1 = a.batch(16, 1);
  CHECK(a0.x.bitwise_equal(b0.x));
  CHECK(a0.y.bitwise_equal(b0.y));
  CHECK(max_abs_diff(a0.x, a1.x) > 0);
  CHECK(a0.y.rows() == 16);
  CHECK(a0.y.cols() == 2);
  CHECK(scaled.batch(16, 0).y.bitwise_equal(scale(a0.y, 0.5f)));
  // The teacher is not the student: its weights come from another stream.
  nn::ParameterStore store;
  nn::Sequential student = toy::mlp(store, shape);
  store.allocate();
  CHECK(max_abs_diff(student.forward(a0.x).out, a0.y) > 0);
}

TEST_CASE("replica_divergence finds the rank that drifted") {
  for (int n : {1, 2, 3, 4}) {
    CAPTURE(n);
    testing::on_ranks(n, [&](Communicator& comm) {
      Tensor w = randn(3, 5, 11);
      CHECK(replica_divergence(comm, w) == 0.0);
      if (comm.rank() == n - 1 && n > 1) w.data()[14] += 0.25f;
      const double d = replica_divergence(comm, w);
      CHECK(d == (n > 1 ? doctest::Approx(0.25).epsilon(1e-6) : doctest::Approx(0.0)));
      if (comm.rank() == 0) w.data()[0] = std::numeric_limits<float>::quiet_NaN();
      CHECK(std::isnan(replica_divergence(comm, w)));  // NaN is never "equal"
    });
  }
}

// Wrong versions this was checked against: a rename over whatever is there (a device node
// becomes a JSON file, run as root); --csv-dir / accepted (files land in the root).
TEST_CASE("output files: never over something that is not a regular file, never in /") {
  namespace fs = std::filesystem;
  CHECK_THROWS_AS(write_file_atomic("/dev/null", "{}"), UsageError);
  CHECK(fs::is_character_file("/dev/null"));
  const fs::path folder =
      fs::temp_directory_path() / ("shardlab_out_" + std::to_string(::getpid()));
  fs::create_directories(folder / "taken");
  CHECK_THROWS_AS(write_file_atomic(folder / "taken", "{}"), UsageError);
  CHECK(fs::is_directory(folder / "taken"));
  write_file_atomic(folder / "new.json", "{}");
  write_file_atomic(folder / "new.json", "[]");  // a regular file is replaced
  CHECK(fs::file_size(folder / "new.json") == 2);
  CHECK_THROWS_AS(check_writable_file(folder / "taken", "--trace"), UsageError);
  CHECK_THROWS_AS(check_writable_file("", "--trace"), UsageError);
  CHECK_NOTHROW(check_writable_file(folder / "trace.json", "--trace"));
  CHECK_THROWS_AS(check_writable_folder("/"), UsageError);
  CHECK_THROWS_AS(check_writable_folder("/./"), UsageError);
  CHECK_NOTHROW(check_writable_folder(folder));
  fs::remove_all(folder);
}

TEST_CASE("a whole-number flag says 2.0 is not a whole number, and 0 is out of range") {
  const CLI::Validator v = cli::whole(1, 1024);
  auto says = [&](std::string text) { return v(text); };
  CHECK(says("3").empty());
  CHECK(says("1024").empty());
  CHECK(says("2.0") == "'2.0' is not a whole number");
  CHECK(says("1e3") == "'1e3' is not a whole number");
  CHECK(says("abc") == "'abc' is not a whole number");
  CHECK(says("0") == "0 is outside [1, 1024]");
  CHECK(says("99999999999999999999") == "99999999999999999999 is outside [1, 1024]");
}
