// DeviceMesh: coordinates are the row-major reshape of the world ranks (last axis
// innermost), and each axis communicator holds exactly the ranks that differ along it.
//
// Wrong versions this suite was checked against: the first axis innermost (coordinates);
// an axis group keyed by world rank instead of coordinate (group members in order); the
// colour ignoring one of the other axes (group sizes).
#include <doctest/doctest.h>

#include "shardlab/check.hpp"
#include "shardlab/mesh.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;

namespace {
/// On every rank: each axis group holds the world ranks that share the other coordinates,
/// in coordinate order, and an allreduce over the axis sums exactly them.
void check_mesh(Communicator& world, const std::vector<int>& shape,
                const std::vector<std::string>& names) {
  DeviceMesh mesh(world, shape, names);
  const int r = world.rank();
  CHECK(mesh.rank_at(mesh.coords()) == r);
  for (int a = 0; a < mesh.ndim(); ++a) {
    const std::string& name = names[static_cast<std::size_t>(a)];
    Communicator& axis = mesh.axis(name);
    REQUIRE(axis.size() == shape[static_cast<std::size_t>(a)]);
    CHECK(axis.rank() == mesh.coord(name));
    const std::vector<std::int32_t> members = axis.gather_values(static_cast<std::int32_t>(r));
    for (int k = 0; k < axis.size(); ++k) {
      std::vector<int> c = mesh.coords();
      c[static_cast<std::size_t>(a)] = k;
      CHECK_MESSAGE(members[static_cast<std::size_t>(k)] == mesh.rank_at(c),
                    "rank " << r << ", axis " << name << ": member " << k << " is world rank "
                            << members[static_cast<std::size_t>(k)] << ", expected "
                            << mesh.rank_at(c));
    }
    std::vector<std::int64_t> sum(1, r);
    axis.allreduce(sum);
    std::int64_t want = 0;
    for (std::int32_t m : members) want += m;
    CHECK(sum[0] == want);
  }
  // One allreduce per axis: the summed axis counters show one call per axis.
  CHECK(mesh.axis_stats()[Op::allreduce].calls == static_cast<std::uint64_t>(mesh.ndim()));
}
}  // namespace

TEST_SUITE("mesh") {
  TEST_CASE("coordinates are row-major with the last axis innermost, as init_device_mesh") {
    run_threads(8, [](Communicator& world) {
      DeviceMesh mesh(world, {2, 2, 2}, {"pp", "dp", "tp"});
      const std::vector<int> want = {world.rank() / 4, world.rank() / 2 % 2, world.rank() % 2};
      CHECK(mesh.coords() == want);
      CHECK(mesh.coords_of(5) == std::vector<int>{1, 0, 1});
      CHECK(mesh.rank_at({1, 1, 0}) == 6);
    });
  }
  TEST_CASE("each axis communicator holds the ranks that differ along it, in order") {
    run_threads(6, [](Communicator& w) { check_mesh(w, {2, 3}, {"dp", "tp"}); });
    run_threads(6, [](Communicator& w) { check_mesh(w, {3, 2}, {"dp", "tp"}); });
    run_threads(8, [](Communicator& w) { check_mesh(w, {2, 2, 2}, {"pp", "dp", "tp"}); });
    run_threads(4, [](Communicator& w) { check_mesh(w, {1, 4}, {"pp", "dp"}); });
    run_threads(1, [](Communicator& w) { check_mesh(w, {1}, {"dp"}); });
  }
  TEST_CASE("a mesh that does not cover the job, or repeats a name, is an Error") {
    CHECK_THROWS_WITH_AS(run_threads(4,
                                     [](Communicator& w) {
                                       DeviceMesh m(w, {3, 2}, {"a", "b"});
                                     }),
                         doctest::Contains("is 6 ranks, but the job has 4"), Error);
    CHECK_THROWS_AS(run_threads(4,
                                [](Communicator& w) {
                                  DeviceMesh m(w, {2, 2}, {"a", "a"});
                                }),
                    Error);
  }
}
