// Chapter 03 tests of the chapter's own algorithms (not the exercise): naive,
// pipelined ring and recursive doubling equal the native allreduce and send exactly
// their formula's bytes. Compiled against the solution only.
#include <doctest/doctest.h>

#include <functional>

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
}
