// Chapter 03 tests of the chapter's own algorithms (not the exercise): naive,
// pipelined ring, recursive doubling and the hierarchical one equal the native allreduce
// and send exactly their formula's bytes, to each peer, on one host and on several; the
// ring as the allreduce a trainer plugs in (a tensor, a view of a flat gradient buffer);
// the algorithms by name. Compiled against the solution only.
//
// Wrong versions the last three test cases were checked against:
//   the tensor ring over data.shape()[0] elements (the rows of a 2-D view, not all of
//     them) -> "rank 1, element 7 of the view: got 108, want 212" on the (7, 13) view
//   the tensor ring dropping the view's last element (span().first(size - 1)) ->
//     "rank 0, element 4098 of the view: got 103, want 209", and the bytes
//   the tensor ring as comm.allreduce (right values, right bytes) -> "called the native
//     allreduce"
//   one Workspace shared by every rank (static instead of thread_local) -> "rank 0,
//     element 0 of the view: got 226, want 221" (a race: caught here at 2 ranks)
//   no type check in the tensor ring -> Tensor's own "holds f16", not the ring's words
//   "pipelined" by name running the plain ring (same values, same bytes) -> "send calls
//     differ from pipelined's function"
//   "naive" by name running recursive doubling -> "send calls differ from naive's function"
//   formula_bytes_sent("native") giving the ring's formula -> "native on rank 0 sent 24596
//     bytes, the formula says 24592" (4 ranks, 4099 elements)
//   an unknown name running the native allreduce instead of throwing -> "did NOT throw"
// and the hierarchical allreduce and the bytes between hosts were checked against:
//   the hierarchical allreduce sending the whole buffer across the hosts, not its chunk
//     -> "named.total().bytes_sent == formula is NOT correct" (S where S/g is due)
//   the across ring on chunk `local rank` instead of the chunk the rank owns after the
//     reduce-scatter -> "rank 2, element 0: by name 12, the function 12, want 15"
//   the ring's formula without the wrap edge (rank N-1 sending nowhere) -> the hand-worked
//     {6000020, 6000016} of two hosts
//   hosts numbered in sorted order of their names -> {0, 1, 0, 2} for "b", "a", "b", "c"

#include <doctest/doctest.h>

#include <functional>
#include <numeric>
#include <string>

#include "ring_allreduce.hpp"
#include "ring_check.hpp"
#include "shardlab/check.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::for_each_world_size;
using shardlab::testing::on_ranks;
namespace check = ch03::check;

namespace {
using Algorithm = std::function<void(Communicator&, std::span<float>, ch03::Workspace&)>;

void check_algorithm(const char* name, const Algorithm& run) {
  for_each_world_size([&](int n) {
    for (std::size_t count :
         {std::size_t{0}, std::size_t{1}, static_cast<std::size_t>(n) + 1, std::size_t{4099}}) {
      CAPTURE(count);
      on_ranks(n, [&](Communicator& comm) {
        std::vector<float> mine = ch03::check::tagged_input(count, comm.rank(), n), native = mine;
        ch03::Workspace scratch;
        const CommStats before = comm.stats();
        run(comm, mine, scratch);
        const OpStats t = comm.stats().since(before).total();
        comm.allreduce(native);
        CHECK_MESSAGE(mine == native, name << " on rank " << comm.rank() << " differs from native");
        CHECK(t.bytes_sent == ch03::formula_bytes_sent(name, count, comm.rank(), n));
      });
    }
  });
}
/// The ring's reduce-scatter with its parts spelled out, correct unless one is changed: the
/// checker's own test. `send_from_copy` sends a copy of the chunk (which is right);
/// `offset_by_one` sends chunk (r - s + 1) (wrong); `even_chunks` cuts S / N elements per
/// chunk, the last taking the rest (wrong when N does not divide S).
struct RingVariant {
  bool send_from_copy = false, offset_by_one = false, even_chunks = false;
  int skip_add_at = -1;  // the step at which every rank forgets to add what arrived
  void operator()(Communicator& comm, std::span<float> data, ch03::Workspace&) const {
    const int N = comm.size(), r = comm.rank();
    auto chunk = [&](int c) {
      c = ch03::wrap(c, N);
      if (!even_chunks) return ch03::chunk(data, N, c);
      const std::size_t len = data.size() / static_cast<std::size_t>(N);
      const std::size_t begin = static_cast<std::size_t>(c) * len;
      return data.subspan(begin, c == N - 1 ? data.size() - begin : len);
    };
    for (int s = 0; s < N - 1; ++s) {
      const std::span<float> out = chunk(r - s + (offset_by_one ? 1 : 0));
      const std::span<float> mine = chunk(r - s - 1);
      std::vector<float> in(mine.size()), copy(out.begin(), out.end());
      if (send_from_copy)
        comm.sendrecv(copy, ch03::wrap(r + 1, N), in, ch03::wrap(r - 1, N), s);
      else
        comm.sendrecv(out, ch03::wrap(r + 1, N), in, ch03::wrap(r - 1, N), s);
      if (s == skip_add_at) continue;
      for (std::size_t i = 0; i < mine.size(); ++i) mine[i] += in[i];
    }
  }
};

/// The first failure message a variant produces on 4 ranks and `count` elements.
std::string message_of(const RingVariant& variant, std::size_t count) {
  std::string message;
  try {
    run_threads(4, [&](Communicator& comm) {
      std::vector<float> data = check::tagged_input(count, comm.rank(), 4);
      check::StepLog log;
      ch03::Workspace scratch;
      check::run_logged(
          comm, data, log, [&] { variant(comm, data, scratch); },
          [&](const check::StepLog& l, std::span<const float> d, bool complete) {
            return check::reduce_scatter_steps_error(l, d, comm.rank(), 4, complete);
          });
      const std::string steps = check::reduce_scatter_steps_error(log, data, comm.rank(), 4);
      if (!steps.empty()) throw CommError(steps);
      const std::string result = check::reduce_scatter_error(data, comm.rank(), 4);
      if (!result.empty()) throw CommError(result);
    });
  } catch (const std::exception& e) {
    message = e.what();
  }
  return message;
}

}  // namespace

TEST_SUITE("ch03.algorithms") {
  TEST_CASE("the ring checker judges messages by what they carry, and names the step") {
    // Sending from a copy of the chunk is right.
    CHECK(message_of({.send_from_copy = true}, 40).empty());
    CHECK(message_of({}, 40).empty());
    // The wrong chunk: named by step and chunk, when N divides S (rank r sends chunk r + 1
    // at step 0 instead of chunk r) ...
    const std::string even_split = message_of({.offset_by_one = true}, 40);
    const bool named = even_split.find("reduce-scatter step 0: sent chunk ") != std::string::npos &&
                       even_split.find(", but this step sends chunk ") != std::string::npos &&
                       even_split.find("(step s sends chunk (r - s) mod N") != std::string::npos;
    CHECK_MESSAGE(named, even_split);
    // ... and when it does not, so that a chunk of another size arrives: the same words,
    // not just the communicator's size mismatch.
    const std::string uneven = message_of({.offset_by_one = true}, 10);
    const bool named_uneven =
        uneven.find("reduce-scatter step 0: sent chunk ") != std::string::npos &&
        uneven.find(", but this step sends chunk ") != std::string::npos;
    CHECK_MESSAGE(named_uneven, uneven);
    // A sum dropped at step 1 (every rank forgets to add what arrived): the step is named.
    const std::string dropped = message_of({.skip_add_at = 1}, 40);
    CHECK_MESSAGE(dropped.find("was lost at step 1") != std::string::npos, dropped);
    // An all-gather that sends a chunk this rank has not got yet: named, not a crash.
    std::string early;
    try {
      run_threads(4, [&](Communicator& comm) {
        const int r = comm.rank();
        std::vector<float> data(8, -1.0f);  // only the owned chunk filled, as after the half
        const auto owned = check::chunk_range(8, 4, ch03::owned_chunk(r, 4));
        for (std::int64_t i = owned.offset; i < owned.offset + owned.length; ++i)
          data[static_cast<std::size_t>(i)] =
              15.0f + 1024.0f * 4 * static_cast<float>(ch03::owned_chunk(r, 4));
        check::StepLog log;
        log.attach(comm);
        const auto send = check::chunk_range(8, 4, ch03::wrap(r, 4));  // the wrong index
        const auto recv = check::chunk_range(8, 4, ch03::wrap(r - 1, 4));
        comm.sendrecv(std::span<float>(data).subspan(static_cast<std::size_t>(send.offset), 2),
                      ch03::wrap(r + 1, 4),
                      std::span<float>(data).subspan(static_cast<std::size_t>(recv.offset), 2),
                      ch03::wrap(r - 1, 4), 0);
        const std::string steps = check::allgather_steps_error(log, data, r, 4, false);
        if (!steps.empty()) throw CommError(steps);
      });
    } catch (const std::exception& e) {
      early = e.what();
    }
    CHECK_MESSAGE(early.find("hold no chunk's data") != std::string::npos, early);
    // Chunks of S / N elements when N does not divide S: the boundaries are off.
    const std::string even = message_of({.even_chunks = true}, 10);
    CHECK_MESSAGE(even.find("the chunks have 3 3 2 2 elements") != std::string::npos, even);
  }

  TEST_CASE("naive allreduce: everything through rank 0, bitwise native (same rank order)") {
    check_algorithm("naive", ch03::naive_allreduce);
    // Random floats too: rank 0 adds in rank order, exactly as the threads backend does.
    on_ranks(3, [](Communicator& comm) {
      Tensor x = randn(1, 999, 5 + static_cast<std::uint64_t>(comm.rank())), native = x.clone();
      ch03::Workspace scratch;
      ch03::naive_allreduce(comm, x.span(), scratch);
      comm.allreduce(native);
      CHECK(x.bitwise_equal(native));
    });
  }
  TEST_CASE("recursive doubling, powers of two and not") {
    check_algorithm("recursive_doubling", ch03::recursive_doubling_allreduce);
  }
  TEST_CASE("pipelined ring, segments smaller than, equal to and larger than a chunk") {
    for (std::size_t segment : {1u, 7u, 1000u, 100000u}) {
      CAPTURE(segment);
      check_algorithm("pipelined",
                      [segment](Communicator& comm, std::span<float> d, ch03::Workspace& w) {
                        ch03::pipelined_ring_allreduce(comm, d, segment, w);
                      });
    }
  }
  TEST_CASE("the pipelined ring's partners agree on every bit of random data") {
    on_ranks(4, [](Communicator& comm) {
      Tensor x = randn(1, 5003, 9 + static_cast<std::uint64_t>(comm.rank())), ring = x.clone();
      ch03::Workspace scratch;
      ch03::pipelined_ring_allreduce(comm, x.span(), 64, scratch);
      ch03::ring_allreduce(comm, ring.span(), scratch);
      CHECK_MESSAGE(x.bitwise_equal(ring),
                    "pipelined and plain ring add in the same order, so must agree");
      Tensor first = x.clone();
      comm.broadcast(first, 0);
      CHECK(x.bitwise_equal(first));
    });
  }

  TEST_CASE("the ring plugs in as a trainer's allreduce: a tensor view of a flat buffer") {
    // Chapter 02's AllreduceFn. Rank q holds (q + 1)(i mod 7 + 1) + 100 at element i of a
    // flat buffer; the ring reduces a view of it (a bucket: a 1-D range, or a 2-D tensor
    // inside it) and must leave every element outside the view as it was.
    const std::function<void(Communicator&, Tensor&)> allreduce = ch03::ring_allreduce;
    auto mine = [](std::int64_t i, int q) {
      return static_cast<float>((q + 1) * (i % 7 + 1) + 100);
    };
    for_each_world_size([&](int n) {
      on_ranks(n, [&](Communicator& comm) {
        const int r = comm.rank();
        Tensor flat(5000);
        // Views of several sizes, larger then smaller (the ring reuses its scratch).
        for (const auto& [offset, shape] : std::vector<std::pair<std::int64_t, Shape>>{
                 {13, Shape{4099}}, {3, Shape{7, 13}}, {4999, Shape{1}}, {0, Shape{0}}}) {
          for (std::int64_t i = 0; i < flat.size(); ++i) flat[i] = mine(i, r);
          Tensor view = flat.view(offset, shape);
          const auto count = static_cast<std::size_t>(view.size());
          CAPTURE(count);
          const CommStats before = comm.stats();
          allreduce(comm, view);
          const CommStats used = comm.stats().since(before);
          for (std::int64_t i = 0; i < flat.size(); ++i) {
            const bool inside = i >= offset && i < offset + view.size();
            float want = mine(i, r);
            if (inside) {
              want = 0;
              for (int q = 0; q < n; ++q) want += mine(i, q);
            }
            if (flat[i] != want) {
              FAIL_CHECK("rank " << r << ", element " << i - offset << " of the view"
                                 << std::string(inside ? "" : " (outside it)") << ": got "
                                 << flat[i] << ", want " << want);
              break;
            }
          }
          CHECK_MESSAGE(used[Op::allreduce].calls == 0, "called the native allreduce");
          CHECK(used.total().bytes_sent == ch03::formula_bytes_sent("ring", count, r, n));
        }
      });
    });
  }

  TEST_CASE("the tensor ring refuses what it cannot add, naming itself") {
    on_ranks(1, [](Communicator& comm) {
      Tensor halves = zeros(Shape{16}, DType::f16);
      CHECK_THROWS_WITH_AS(ch03::ring_allreduce(comm, halves),
                           doctest::Contains("ch03::ring_allreduce: the ring adds float32"),
                           shardlab::Error);
    });
  }

  TEST_CASE("every algorithm by name: the exact sum, and the same messages as the function") {
    const std::size_t segment = 7;
    for_each_world_size([&](int n) {
      on_ranks(n, [&](Communicator& comm) {
        const int r = comm.rank();
        const std::size_t count = 4099;
        ch03::Workspace scratch;
        // Two hosts where the ranks split evenly (the hierarchical algorithm's groups).
        ch03::HostGroups groups = ch03::group_by_host(comm, ch03::blocks(n, n % 2 ? n : n / 2));
        auto stats = [&] {
          CommStats all = comm.stats();
          all += groups.local->stats(), all += groups.across->stats();
          return all;
        };
        for (std::string_view name : ch03::algorithms) {
          CAPTURE(name);
          // By name, on a tensor...
          Tensor by_name = Tensor::from_vector(check::tagged_input(count, r, n));
          const CommStats before = stats();
          ch03::allreduce(name, comm, by_name, segment, scratch, &groups);
          const CommStats named = stats().since(before);
          // ... and the function itself, on the same data.
          std::vector<float> direct = check::tagged_input(count, r, n);
          const CommStats start = stats();
          if (name == "naive") ch03::naive_allreduce(comm, direct, scratch);
          if (name == "ring") ch03::ring_allreduce(comm, direct, scratch);
          if (name == "pipelined") ch03::pipelined_ring_allreduce(comm, direct, segment, scratch);
          if (name == "recursive_doubling")
            ch03::recursive_doubling_allreduce(comm, direct, scratch);
          if (name == "hierarchical") ch03::hierarchical_allreduce(groups, direct, scratch);
          if (name == "native") comm.allreduce(std::span<float>(direct), ReduceOp::sum);
          const CommStats called = stats().since(start);
          // The exact sum (small integers: every order agrees), element by element.
          std::vector<float> sum(count, 0.0f);
          for (int q = 0; q < n; ++q) {
            const std::vector<float> v = check::tagged_input(count, q, n);
            for (std::size_t i = 0; i < count; ++i) sum[i] += v[i];
          }
          for (std::size_t i = 0; i < count; ++i)
            if (by_name[static_cast<std::int64_t>(i)] != sum[i] || direct[i] != sum[i]) {
              FAIL_CHECK("rank " << r << ", element " << i << ": by name "
                                 << by_name[static_cast<std::int64_t>(i)] << ", the function "
                                 << direct[i] << ", want " << sum[i]);
              break;
            }
          for (std::size_t k = 0; k < op_count; ++k) {
            const auto op = static_cast<Op>(k);
            CHECK_MESSAGE(named[op].calls == called[op].calls,
                          op_name(op) << " calls differ from " << name << "'s function");
            CHECK_MESSAGE(named[op].bytes_sent == called[op].bytes_sent,
                          op_name(op) << " bytes differ from " << name << "'s function");
          }
          const std::vector<std::size_t> to =
              ch03::formula_bytes_to(name, count, r, ch03::blocks(n, n % 2 ? n : n / 2));
          const std::size_t formula = name == "native"
                                          ? ch03::formula_bytes_sent(name, count, r, n)
                                          : std::accumulate(to.begin(), to.end(), std::size_t{0});
          CHECK_MESSAGE(named.total().bytes_sent == formula,
                        name << " on rank " << r << " sent " << named.total().bytes_sent
                             << " bytes, the formula says " << formula);
        }
        Tensor x(4);
        CHECK_THROWS_WITH_AS(ch03::allreduce("carrier-pigeon", comm, x, segment, scratch),
                             doctest::Contains("no allreduce algorithm 'carrier-pigeon'"),
                             shardlab::Error);
      });
    });
  }

  // -------------------------------------------------------------------------------------
  // Hosts: the hierarchical allreduce, and every algorithm's bytes to each peer and
  // between hosts.

  /// Runs `name` on `placement`'s hosts and returns, on each rank, the bytes it sent to
  /// each rank, counted message by message (the communicator's and the groups' messages).
  std::vector<std::size_t> bytes_to_each(Communicator & comm, ch03::HostGroups & groups,
                                         std::string_view name, std::vector<float> & data) {
    std::vector<std::size_t> to(static_cast<std::size_t>(comm.size()), 0);
    auto watch = [&](Communicator& c, const std::vector<int>& members) {
      c.trace_messages([&to, members](const MessageEvent& e) {
        if (e.op != Op::send) return;
        const int peer = members.empty() ? e.peer : members[static_cast<std::size_t>(e.peer)];
        to[static_cast<std::size_t>(peer)] += e.bytes;
      });
    };
    watch(comm, {});
    watch(*groups.local, groups.local_ranks);
    watch(*groups.across, groups.across_ranks);
    Tensor t = Tensor::from_vector(data);
    ch03::Workspace scratch;
    ch03::allreduce(name, comm, t, 5, scratch, &groups);
    data.assign(t.span().begin(), t.span().end());
    comm.trace_messages({}), groups.local->trace_messages({}), groups.across->trace_messages({});
    return to;
  }

  /// host = r / per_host (blocks), or r % hosts (round robin: mpirun --map-by node).
  ch03::Placement round_robin(int ranks, int hosts) {
    ch03::Placement p;
    for (int r = 0; r < ranks; ++r) p.host.push_back(r % hosts);
    return p;
  }

  TEST_CASE("the hierarchical allreduce: the exact sum, and to each peer what the formula says") {
    for (int n : {1, 2, 4, 6, 8}) {
      std::vector<ch03::Placement> placements{ch03::blocks(n, n)};
      if (n % 2 == 0) placements.push_back(ch03::blocks(n, n / 2));
      if (n % 2 == 0 && n > 2) placements.push_back(round_robin(n, 2));
      if (n == 6) placements.push_back(ch03::blocks(6, 2)), placements.push_back(round_robin(6, 3));
      if (n == 8) placements.push_back(ch03::blocks(8, 2));
      for (const ch03::Placement& placement : placements) {
        for (std::size_t count : {std::size_t{0}, std::size_t{3}, std::size_t{4099}}) {
          const int hosts = placement.hosts();
          CAPTURE(n);
          CAPTURE(hosts);
          CAPTURE(count);
          on_ranks(n, [&](Communicator& comm) {
            const int r = comm.rank();
            ch03::HostGroups groups = ch03::group_by_host(comm, placement);
            std::vector<float> mine = check::tagged_input(count, r, n), native = mine;
            const std::vector<std::size_t> to = bytes_to_each(comm, groups, "hierarchical", mine);
            comm.allreduce(native);
            for (std::size_t i = 0; i < count; ++i)
              if (mine[i] != native[i]) {
                FAIL_CHECK("rank " << r << ", element " << i << ": got " << mine[i] << ", want "
                                   << native[i]);
                break;
              }
            const std::vector<std::size_t> want =
                ch03::formula_bytes_to("hierarchical", count, r, placement);
            for (int q = 0; q < n; ++q)
              CHECK_MESSAGE(to[static_cast<std::size_t>(q)] == want[static_cast<std::size_t>(q)],
                            "rank " << r << " sent " << to[static_cast<std::size_t>(q)]
                                    << " bytes to rank " << q << ", the formula says "
                                    << want[static_cast<std::size_t>(q)]);
          });
        }
      }
    }
  }

  TEST_CASE("every algorithm sends each peer what its formula says, on two hosts and round robin") {
    for (int n : {4, 6}) {
      for (const ch03::Placement& placement : {ch03::blocks(n, n / 2), round_robin(n, 2)}) {
        on_ranks(n, [&](Communicator& comm) {
          const int r = comm.rank();
          ch03::HostGroups groups = ch03::group_by_host(comm, placement);
          for (std::string_view name : ch03::algorithms) {
            if (name == "native") continue;
            const bool round_robin_placement = placement.host[1] == 1;
            CAPTURE(name);
            CAPTURE(n);
            CAPTURE(round_robin_placement);
            std::vector<float> mine = check::tagged_input(1001, r, n);
            const std::vector<std::size_t> to = bytes_to_each(comm, groups, name, mine);
            CHECK(to == ch03::formula_bytes_to(name, 1001, r, placement));
          }
        });
      }
    }
  }

  TEST_CASE("bytes between hosts, worked out by hand: 4 ranks, 2 hosts, 1000003 floats") {
    // S = 4000012 bytes; the ring's chunks over 4 ranks: 250001, 250001, 250001, 250000.
    const ch03::Placement two = ch03::blocks(4, 2), alternating = round_robin(4, 2);
    using V = std::vector<std::size_t>;
    // The ring crosses twice: rank 1 -> 2 sends 2S - |c2| - |c3| = 1500005 floats, rank 3 -> 0
    // sends 2S - |c0| - |c1| = 1500004.
    CHECK(ch03::formula_link_bytes("ring", 1000003, two) == V{6000020, 6000016});
    CHECK(ch03::formula_link_bytes("pipelined", 1000003, two) == V{6000020, 6000016});
    // Round robin: every edge of the ring crosses; 2(N-1) S in all.
    const V ring_rr = ch03::formula_link_bytes("ring", 1000003, alternating);
    CHECK(ring_rr[0] + ring_rr[1] == 6 * 4000012);
    // Hierarchical: each rank sends its host-reduced chunk (of 2: 500002 and 500001 floats)
    // to its counterpart: S from each host, however the ranks are placed.
    CHECK(ch03::formula_link_bytes("hierarchical", 1000003, two) == V{4000012, 4000012});
    CHECK(ch03::formula_link_bytes("hierarchical", 1000003, alternating) == V{4000012, 4000012});
    // Naive: ranks 2 and 3 send S to rank 0 and get S back; recursive doubling's second
    // round (distance 2) swaps whole buffers between the hosts.
    CHECK(ch03::formula_link_bytes("naive", 1000003, two) == V{8000024, 8000024});
    CHECK(ch03::formula_link_bytes("recursive_doubling", 1000003, two) == V{8000024, 8000024});
    CHECK(ch03::formula_link_bytes("native", 1000003, two).empty());
  }

  TEST_CASE("placements: hosts numbered in order of first appearance; uneven hosts refused") {
    CHECK(ch03::placement_of({"b", "a", "b", "c"}).host == std::vector<int>{0, 1, 0, 2});
    CHECK(ch03::blocks(6, 3).ranks_on(1) == std::vector<int>{3, 4, 5});
    CHECK_THROWS_WITH_AS(ch03::blocks(6, 4), doctest::Contains("4 ranks per host do not divide 6"),
                         shardlab::Error);
    const ch03::Placement uneven = ch03::placement_of({"a", "a", "b"});
    CHECK(uneven.uneven() ==
          "the hierarchical allreduce needs the same number of ranks on every host; host 1 has 1, "
          "host 0 has 2");
    on_ranks(3, [&](Communicator& comm) {
      CHECK_THROWS_WITH_AS(ch03::group_by_host(comm, uneven), doctest::Contains("host 1 has 1"),
                           shardlab::UsageError);
    });
  }
}
