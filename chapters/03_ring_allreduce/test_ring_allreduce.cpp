// Chapter 03 tests of the learner's ring: compiled against the solution (must pass) and
// the exercise stubs (every case must fail). World sizes 1, 2, 3, 4, 8; counts 0, < N,
// not divisible by N, and large.
#include <doctest/doctest.h>

#include "ring_allreduce.hpp"
#include "ring_check.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::for_each_world_size;
namespace check = ch03::check;

namespace {

std::vector<std::size_t> counts_for(int n) {
  const auto N = static_cast<std::size_t>(n);
  return {0, 1, N > 1 ? N - 1 : 1, N, 5 * N + 2, 4099};
}

/// A reduce-scatter that sends the wrong chunk (r - s + 1 instead of r - s): what the
/// checker must catch. (Equal chunks only, so the sizes still match.)
void reduce_scatter_wrong_chunk(Communicator& comm, std::span<float> data) {
  const int N = comm.size(), r = comm.rank();
  const std::size_t len = data.size() / static_cast<std::size_t>(N);
  auto chunk = [&](int c) {
    return data.subspan(static_cast<std::size_t>(ch03::wrap(c, N)) * len, len);
  };
  std::vector<float> in(len);
  for (int s = 0; s < N - 1; ++s) {
    const std::span<float> mine = chunk(r - s - 1);
    comm.sendrecv(chunk(r - s + 1), ch03::wrap(r + 1, N), in, ch03::wrap(r - 1, N), s);
    for (std::size_t i = 0; i < len; ++i) mine[i] += in[i];
  }
}

}  // namespace

TEST_SUITE("ch03") {
  TEST_CASE("reduce-scatter: each rank's chunk (r+1) mod N holds the sum over all ranks") {
    // First, the checker itself: a ring with a wrong chunk index is named precisely.
    std::string wrong_steps, result;
    run_threads(4, [&](Communicator& comm) {
      std::vector<float> data = check::tagged_input(40, comm.rank(), 4);
      check::StepLog log;
      log.attach(comm);
      reduce_scatter_wrong_chunk(comm, data);
      if (comm.rank() != 1) return;
      wrong_steps = check::reduce_scatter_steps_error(log, data, 1, 4);
      result = check::reduce_scatter_error(data, 1, 4);
    });
    CHECK(wrong_steps ==
          "rank 1, reduce-scatter step 0: sent chunk 2, but this step sends chunk 1 (step s sends "
          "chunk "
          "(r - s) mod N and receives chunk (r - s - 1) mod N)");
    CHECK(result.find("rank 1, after reduce-scatter, chunk 2") == 0);

    for_each_world_size([](int n) {
      for (std::size_t count : counts_for(n)) {
        CAPTURE(count);
        run_threads(n, [&](Communicator& comm) {
          std::vector<float> data = check::tagged_input(count, comm.rank(), n);
          check::StepLog log;
          log.attach(comm);
          ch03::Workspace scratch;
          ch03::ring_reduce_scatter(comm, data, scratch);
          // Which chunk each step moved, then what the owned chunk holds.
          const std::string steps = check::reduce_scatter_steps_error(log, data, comm.rank(), n);
          CHECK_MESSAGE(steps.empty(), steps);
          const std::string e = check::reduce_scatter_error(data, comm.rank(), n);
          CHECK_MESSAGE(e.empty(), e);
        });
      }
    });
  }

  TEST_CASE("all-gather: finished chunks reach every rank, each in its place") {
    for_each_world_size([](int n) {
      for (std::size_t count : counts_for(n)) {
        CAPTURE(count);
        run_threads(n, [&](Communicator& comm) {
          // Only the owned chunk is complete (as after reduce-scatter); the rest is junk.
          std::vector<float> data(count, -1.0f);
          const std::vector<float> full = [&] {
            std::vector<float> sum(count, 0.0f);
            for (int q = 0; q < n; ++q) {
              const auto v = check::tagged_input(count, q, n);
              for (std::size_t i = 0; i < count; ++i) sum[i] += v[i];
            }
            return sum;
          }();
          const auto mine =
              shard_range(static_cast<std::int64_t>(count), n, ch03::owned_chunk(comm.rank(), n));
          for (std::int64_t i = mine.offset; i < mine.offset + mine.length; ++i)
            data[static_cast<std::size_t>(i)] = full[static_cast<std::size_t>(i)];
          check::StepLog log;
          log.attach(comm);
          ch03::ring_allgather(comm, data);
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
        run_threads(n, [&](Communicator& comm) {
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
      run_threads(n, [&](Communicator& comm) {
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
        run_threads(n, [&](Communicator& comm) {
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
