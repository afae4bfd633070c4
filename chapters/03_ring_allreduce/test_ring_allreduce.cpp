// Chapter 03 tests of the learner's ring: compiled against the solution (must pass) and
// the exercise stubs (every case must fail). World sizes 1, 2, 3, 4, 8; counts 0, < N,
// not divisible by N, and large.
//
// Wrong versions these tests were checked against (test_algorithms.cpp plants the first
// five in a ring of its own and checks the checker's words, so they stay caught):
//   a correct ring that sends from a copy of its chunk -> passes (chunks are judged by
//     what they carry, not by their address)
//   the chunk index off by one, (r - s + 1) -> "reduce-scatter step 0: sent chunk ..., but
//     this step sends chunk ..." at counts N divides and at counts it does not
//   every rank forgetting to add at step 1 -> "... was lost at step 1"
//   S / N elements per chunk when N does not divide S -> "the chunks have 3 3 2 2 elements"
//   an all-gather that first sends a chunk it does not have yet -> "... hold no chunk's
//     data", not a crash
//   the all-gather's chunks shifted by one -> "all-gather: finished chunks reach every
//     rank" fails with the rank and chunk
//   an isend never waited for -> the communicator names the withdrawn send
//   no reduce-scatter at all (the stub) -> every case fails, "TODO(ch03: ...)"
#include <doctest/doctest.h>

#include <functional>

#include "ring_allreduce.hpp"
#include "ring_check.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::for_each_world_size;
using shardlab::testing::on_ranks;
namespace check = ch03::check;

namespace {

/// The counts N divides come first: a chunk index that is off then shows as the wrong
/// chunk, before uneven chunks make the sizes disagree too.
std::vector<std::size_t> counts_for(int n) {
  const auto N = static_cast<std::size_t>(n);
  return {4 * N, N, 0, 1, N > 1 ? N - 1 : 1, 5 * N + 2, 4099};
}

/// What the all-gather starts from: only the owned chunk complete (as after the
/// reduce-scatter), the rest junk.
std::vector<float> after_reduce_scatter(std::size_t count, int rank, int n) {
  std::vector<float> sum(count, 0.0f), data(count, -1.0f);
  for (int q = 0; q < n; ++q) {
    const auto v = check::tagged_input(count, q, n);
    for (std::size_t i = 0; i < count; ++i) sum[i] += v[i];
  }
  const auto mine = shard_range(static_cast<std::int64_t>(count), n, ch03::owned_chunk(rank, n));
  for (std::int64_t i = mine.offset; i < mine.offset + mine.length; ++i)
    data[static_cast<std::size_t>(i)] = sum[static_cast<std::size_t>(i)];
  return data;
}

/// The learner's reduce-scatter on rank comm.rank(), checked step by step, then by result.
void check_reduce_scatter(
    Communicator& comm, std::size_t count,
    const std::function<void(Communicator&, std::span<float>, ch03::Workspace&)>& reduce_scatter) {
  const int n = comm.size(), r = comm.rank();
  std::vector<float> data = check::tagged_input(count, r, n);
  check::StepLog log;
  ch03::Workspace scratch;
  check::run_logged(
      comm, data, log, [&] { reduce_scatter(comm, data, scratch); },
      [&](const check::StepLog& l, std::span<const float> d, bool complete) {
        return check::reduce_scatter_steps_error(l, d, r, n, complete);
      });
  // Which chunk each step moved, then what the owned chunk holds.
  const std::string steps = check::reduce_scatter_steps_error(log, data, r, n);
  CHECK_MESSAGE(steps.empty(), steps);
  const std::string e = check::reduce_scatter_error(data, r, n);
  CHECK_MESSAGE(e.empty(), e);
}

}  // namespace

TEST_SUITE("ch03") {
  TEST_CASE("reduce-scatter: each rank's chunk (r+1) mod N holds the sum over all ranks") {
    for_each_world_size([](int n) {
      for (std::size_t count : counts_for(n)) {
        CAPTURE(count);
        on_ranks(n, [&](Communicator& comm) {
          check_reduce_scatter(comm, count, ch03::ring_reduce_scatter);
        });
      }
    });
  }

  TEST_CASE("all-gather: finished chunks reach every rank, each in its place") {
    for_each_world_size([](int n) {
      for (std::size_t count : counts_for(n)) {
        CAPTURE(count);
        on_ranks(n, [&](Communicator& comm) {
          std::vector<float> data = after_reduce_scatter(count, comm.rank(), n);
          check::StepLog log;
          check::run_logged(
              comm, data, log, [&] { ch03::ring_allgather(comm, data); },
              [&](const check::StepLog& l, std::span<const float> d, bool complete) {
                return check::allgather_steps_error(l, d, comm.rank(), n, complete);
              });
          const std::string steps = check::allgather_steps_error(log, data, comm.rank(), n);
          CHECK_MESSAGE(steps.empty(), steps);
          const std::string e = check::allgather_error(data, comm.rank(), n);
          CHECK_MESSAGE(e.empty(), e);
        });
      }
    });
  }

  TEST_CASE("ring allreduce equals the native allreduce, bitwise on integer data") {
    // Small integers sum exactly in any order, so ring and native must agree bit for bit
    // even though the ring adds in ring order and the native in rank order.
    for_each_world_size([](int n) {
      for (std::size_t count : counts_for(n)) {
        CAPTURE(count);
        on_ranks(n, [&](Communicator& comm) {
          std::vector<float> ring = check::tagged_input(count, comm.rank(), n), native = ring;
          ch03::Workspace scratch;
          ch03::ring_allreduce(comm, ring, scratch);
          comm.allreduce(native);
          CHECK_MESSAGE(ring == native,
                        "rank " << comm.rank() << ": ring and native allreduce differ");
        });
      }
    });
  }

  TEST_CASE("ring allreduce of random floats is within the rounding bound of native") {
    // Different summation orders of N values differ by at most 2(N-1) u sum_q |x_q|.
    for_each_world_size([](int n) {
      on_ranks(n, [&](Communicator& comm) {
        const Tensor x = randn(1, 3001, 77 + static_cast<std::uint64_t>(comm.rank()));
        Tensor ring = x.clone(), native = x.clone(), magnitude = x.clone();
        for (float& v : magnitude) v = std::fabs(v);
        ch03::Workspace scratch;
        ch03::ring_allreduce(comm, ring.span(), scratch);
        comm.allreduce(native);
        comm.allreduce(magnitude);
        const double bound = 2.0 * (n - 1) * 0x1.0p-24 * max_abs(magnitude);
        CHECK_MESSAGE(max_abs_diff(ring, native) <= bound, "rank " << comm.rank() << ": max diff "
                                                                   << max_abs_diff(ring, native)
                                                                   << " > " << bound);
      });
    });
  }

  TEST_CASE("each rank sends exactly 2S - |c(r+1)| - |c(r+2)| bytes: 2(N-1)/N S when N divides S") {
    for_each_world_size([](int n) {
      for (std::size_t count : counts_for(n)) {
        CAPTURE(count);
        on_ranks(n, [&](Communicator& comm) {
          std::vector<float> data(count, 1.0f);
          ch03::Workspace scratch;
          const CommStats before = comm.stats();
          ch03::ring_allreduce(comm, data, scratch);
          const OpStats t = comm.stats().since(before).total();
          const std::size_t want = ch03::formula_bytes_sent("ring", count, comm.rank(), n);
          CHECK_MESSAGE(t.bytes_sent == want, "rank " << comm.rank() << " sent " << t.bytes_sent
                                                      << " bytes, formula " << want);
          // What I receive is what my left neighbour sends.
          const std::size_t from_left =
              ch03::formula_bytes_sent("ring", count, ch03::wrap(comm.rank() - 1, n), n);
          CHECK_MESSAGE(t.bytes_received == from_left, "rank " << comm.rank() << " received "
                                                               << t.bytes_received
                                                               << " bytes, formula " << from_left);
          // Only point-to-point calls: a ring built on the native collective is not a ring.
          CHECK(comm.stats().since(before)[Op::allreduce].calls == 0);
        });
      }
    });
  }
}
