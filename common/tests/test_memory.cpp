// The memory ledger (memory.hpp): every tensor allocation counted live and at its peak,
// by category, per thread (rank); views counted never; a tensor freed on another thread
// released from the ledger that was charged.
//
// Checked against these wrong versions, each failing the case named:
//   - peak kept as the sum of the categories' peaks: "the total's peak is the peak of the
//     sum" (expected 4000, got 6000);
//   - release charged to the freeing thread's ledger: "a tensor freed on another thread
//     leaves its own rank's ledger" (live 4000 after the free, expected 0);
//   - a Scope that does not restore the category it replaced: "scopes nest";
//   - views counted as allocations: "views allocate nothing" (live 8000, expected 4000);
//   - a Tracker that counts only what it sees and hides it from the thread's ledger:
//     "trackers nest" (thread ledger +0, expected +400).
#include <doctest/doctest.h>

#include <thread>

#include "shardlab/memory.hpp"
#include "shardlab/tensor.hpp"

using namespace shardlab;
using memory::Category;

TEST_CASE("tensors are counted under the scope's category, live and at their peak") {
  memory::Tracker t;
  {
    memory::Scope s(Category::optimizer);
    Tensor m(Shape{1000}, DType::f32);
    Tensor v(Shape{1000}, DType::f32);
    CHECK(t.usage().live(Category::optimizer) == 8000);
    CHECK(memory::current_category() == Category::optimizer);
  }
  CHECK(memory::current_category() == Category::other);
  const memory::Usage u = t.usage();
  CHECK(u.live(Category::optimizer) == 0);
  CHECK(u.peak(Category::optimizer) == 8000);
  CHECK(u.live_total == 0);
  CHECK(u.peak_total == 8000);
  Tensor h(Shape{10}, DType::f16);  // unscoped: other, 2 bytes each
  CHECK(t.usage().live(Category::other) == 20);
}

TEST_CASE("the total's peak is the peak of the sum") {
  memory::Tracker t;
  {
    memory::Scope s(Category::activations);
    Tensor a(Shape{1000}, DType::f32);
  }
  {
    memory::Scope s(Category::grads);
    Tensor g(Shape{500}, DType::f32);
  }
  const memory::Usage u = t.usage();
  CHECK(u.peak(Category::activations) == 4000);
  CHECK(u.peak(Category::grads) == 2000);
  CHECK(u.peak_total == 4000);
  t.reset_peaks();
  CHECK(t.usage().peak_total == 0);
}

TEST_CASE("views allocate nothing") {
  memory::Tracker t;
  memory::Scope s(Category::params);
  Tensor flat(Shape{1000}, DType::f32);
  Tensor a = flat.slice(0, 500), b = flat.view(500, Shape{10, 50}),
         c = flat.reshape(Shape{10, 100});
  CHECK(t.usage().live(Category::params) == 4000);
  Tensor copy = a.clone();
  CHECK(t.usage().live(Category::params) == 6000);
}

TEST_CASE("scopes nest") {
  memory::Scope outer(Category::master);
  {
    memory::Scope inner(Category::comm);
    CHECK(memory::current_category() == Category::comm);
  }
  CHECK(memory::current_category() == Category::master);
}

TEST_CASE("trackers nest, and the thread's own ledger sees everything") {
  const std::uint64_t before = memory::usage().live_total;
  memory::Tracker outer;
  Tensor a(Shape{100}, DType::f32);
  {
    memory::Tracker inner;
    Tensor b(Shape{100}, DType::f32);
    CHECK(inner.usage().live_total == 400);
    CHECK(outer.usage().live_total == 800);
    CHECK(memory::usage().live_total == before + 800);
  }
  CHECK(outer.usage().live_total == 400);
  CHECK(memory::usage().live_total == before + 400);
}

TEST_CASE(
    "each thread (rank) has its own ledger; a tensor freed on another thread leaves its own rank's "
    "ledger") {
  Tensor handed_over;
  memory::Usage while_held, after_free;
  std::thread rank([&] {
    memory::Tracker t;
    {
      memory::Scope s(Category::comm);
      handed_over = Tensor(Shape{1000}, DType::f32);
    }
    CHECK(memory::usage().live(Category::comm) == 4000);
    while_held = t.usage();
    std::thread other([&] { handed_over = Tensor(); });  // freed on a third thread
    other.join();
    after_free = t.usage();
  });
  rank.join();
  CHECK(while_held.live(Category::comm) == 4000);
  CHECK(after_free.live(Category::comm) == 0);
  CHECK(after_free.peak(Category::comm) == 4000);
  // This thread allocated none of it.
  memory::Tracker here;
  CHECK(here.usage().live_total == 0);
}
