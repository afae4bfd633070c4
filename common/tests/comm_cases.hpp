// Communicator behaviour every backend must show. Each case runs on every rank of
// `comm` (threads: run_threads; MPI: the world under mpirun) and checks with doctest.
// Values are small integers, so float sums are exact and results compare bitwise.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace shardlab::cases {

/// Rank r's test data: element i is r * 1000 + i (distinct per rank and element).
inline std::vector<float> rank_values(int rank, std::size_t n, std::size_t offset = 0) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(rank * 1000 + static_cast<int>(offset + i));
  return v;
}

/// Counts that cover the edge cases: 0, fewer than N, not divisible by N, divisible.
inline std::vector<std::size_t> interesting_counts(int n) {
  const auto N = static_cast<std::size_t>(n);
  return {0, 1, N > 1 ? N - 1 : 1, N, 7 * N + 3, 1000};
}

inline void allreduce_all_ops(Communicator& comm) {
  const int n = comm.size();
  for (std::size_t count : interesting_counts(n)) {
    CAPTURE(count);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
      CAPTURE(reduce_op_name(op));
      std::vector<float> buf = rank_values(comm.rank(), count);
      comm.allreduce(buf, op);
      for (std::size_t i = 0; i < count; ++i) {
        float want = 0;
        if (op == ReduceOp::max)
          want = static_cast<float>((n - 1) * 1000 + static_cast<int>(i));
        else if (op == ReduceOp::min)
          want = static_cast<float>(i);
        else {
          for (int r = 0; r < n; ++r) want += static_cast<float>(r * 1000 + static_cast<int>(i));
          if (op == ReduceOp::avg) want /= static_cast<float>(n);
        }
        if (buf[i] != want) {
          FAIL_CHECK("rank " << comm.rank() << " element " << i << ": got " << buf[i]
                             << ", expected " << want);
          break;
        }
      }
    }
  }
  // Integer and double buffers reduce too.
  std::vector<std::int64_t> ints(3, comm.rank() + 1);
  comm.allreduce(ints, ReduceOp::sum);
  CHECK(ints[2] == static_cast<std::int64_t>(n) * (n + 1) / 2);
  std::vector<double> doubles(2, 0.5 * comm.rank());
  comm.allreduce(doubles, ReduceOp::max);
  CHECK(doubles[1] == 0.5 * (n - 1));
}

inline void reduce_and_broadcast(Communicator& comm) {
  const int n = comm.size();
  for (int root = 0; root < n; ++root) {
    CAPTURE(root);
    std::vector<float> buf = rank_values(comm.rank(), 10);
    const std::vector<float> before = buf;
    comm.reduce(buf, ReduceOp::sum, root);
    if (comm.rank() == root) {
      float want0 = 0;
      for (int r = 0; r < n; ++r) want0 += static_cast<float>(r * 1000);
      CHECK(buf[0] == want0);
    } else {
      CHECK_MESSAGE(buf == before, "reduce changed the buffer of non-root rank " << comm.rank());
    }
    std::vector<float> b =
        comm.rank() == root ? rank_values(root, 5) : std::vector<float>(5, -1.0f);
    comm.broadcast(b, root);
    CHECK(b == rank_values(root, 5));
  }
}

inline void reduce_scatter_allgather_alltoall(Communicator& comm) {
  const int n = comm.size();
  const auto N = static_cast<std::size_t>(n);
  const std::size_t block = 3;
  // reduce_scatter: rank r gets the sum over ranks of block r.
  std::vector<float> in = rank_values(comm.rank(), block * N);
  std::vector<float> out(block);
  comm.reduce_scatter(in, out, ReduceOp::sum);
  for (std::size_t i = 0; i < block; ++i) {
    float want = 0;
    for (int r = 0; r < n; ++r)
      want += static_cast<float>(r * 1000 + static_cast<int>(comm.rank() * block + i));
    CHECK(out[i] == want);
  }
  // allgatherv with uneven counts (rank r contributes r + 1 elements), and allgather.
  std::vector<std::size_t> counts(N);
  for (std::size_t r = 0; r < N; ++r) counts[r] = r + 1;
  std::vector<float> mine = rank_values(comm.rank(), counts[static_cast<std::size_t>(comm.rank())]);
  std::vector<float> all(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
  comm.allgatherv(mine, all, counts);
  std::vector<float> want_all;
  for (int r = 0; r < n; ++r) {
    auto v = rank_values(r, counts[static_cast<std::size_t>(r)]);
    want_all.insert(want_all.end(), v.begin(), v.end());
  }
  CHECK(all == want_all);
  std::vector<float> gathered(2 * N);
  comm.allgather(rank_values(comm.rank(), 2), gathered);
  CHECK(gathered[2 * N - 1] == static_cast<float>((n - 1) * 1000 + 1));
  // gatherv to the last rank.
  std::vector<float> at_root(comm.rank() == n - 1 ? want_all.size() : 0);
  comm.gatherv(mine, at_root, counts, n - 1);
  if (comm.rank() == n - 1) CHECK(at_root == want_all);
  // alltoall: block j of rank r goes to rank j, and lands in block r there.
  std::vector<std::int32_t> send(2 * N), recv(2 * N);
  for (std::size_t j = 0; j < 2 * N; ++j) send[j] = comm.rank() * 100 + static_cast<int>(j / 2);
  comm.alltoall(send, recv);
  for (std::size_t r = 0; r < N; ++r) CHECK(recv[2 * r] == static_cast<int>(r) * 100 + comm.rank());
  comm.barrier();
}

inline void point_to_point_ring(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  // sendrecv around a ring cannot deadlock.
  std::vector<float> got(4);
  comm.sendrecv(rank_values(r, 4), right, got, left, 3);
  CHECK(got == rank_values(left, 4));
  // Non-blocking: post the receive, send, wait for both; two messages with one tag arrive
  // in order.
  std::vector<float> a(2), b(2);
  Request recvs[2] = {comm.irecv(a, left, 9), comm.irecv(b, left, 9)};
  const std::vector<float> first = rank_values(r, 2), second = rank_values(r, 2, 50);
  Request sends[2] = {comm.isend(first, right, 9), comm.isend(second, right, 9)};
  comm.wait_all(sends);
  comm.wait_all(recvs);
  CHECK(a == rank_values(left, 2));
  CHECK(b == rank_values(left, 2, 50));
  // Blocking send and recv, ordered so they cannot deadlock: even ranks send first.
  if (n > 1) {
    std::vector<std::int64_t> x(1, r), y(1, -1);
    if (r % 2 == 0) {
      comm.send(x, right, 1);
      comm.recv(y, left, 1);
    } else {
      comm.recv(y, left, 1);
      comm.send(x, right, 1);
    }
    CHECK(y[0] == left);
  }
}

inline void split_by_parity(Communicator& comm) {
  // Colors: even and odd ranks; key -rank reverses the order inside each.
  const int color = comm.rank() % 2;
  auto sub = comm.split(color, -comm.rank());
  std::vector<int> members;
  for (int q = 0; q < comm.size(); ++q)
    if (q % 2 == color) members.push_back(q);
  std::reverse(members.begin(), members.end());
  REQUIRE(sub->size() == static_cast<int>(members.size()));
  CHECK(members[static_cast<std::size_t>(sub->rank())] == comm.rank());
  std::vector<std::int32_t> sum(1, comm.rank());
  sub->allreduce(sum);
  CHECK(sum[0] == std::accumulate(members.begin(), members.end(), 0));
  CHECK(sub->stats()[Op::allreduce].calls == 1);
}

inline void counters_match_formula(Communicator& comm) {
  const int n = comm.size();
  const std::size_t count = 4 * static_cast<std::size_t>(n) * 8;  // divisible by N
  std::vector<float> buf(count, 1.0f);
  const CommStats before = comm.stats();
  comm.allreduce(buf);
  const OpStats s = comm.stats().since(before)[Op::allreduce];
  CHECK(s.calls == 1);
  // A ring-shaped allreduce moves 2(N-1)/N * S bytes each way per rank.
  const std::uint64_t S = count * sizeof(float);
  CHECK(s.bytes_sent == 2 * (n - 1) * S / n);
  CHECK(s.bytes_received == 2 * (n - 1) * S / n);
  // Point to point: exactly the message, both ends; to oneself, nothing.
  const CommStats mark = comm.stats();
  std::vector<float> got(6);
  comm.sendrecv(std::vector<float>(6, 1.0f), (comm.rank() + 1) % n, got, (comm.rank() + n - 1) % n);
  const OpStats p = comm.stats().since(mark)[Op::sendrecv];
  CHECK(p.calls == 1);
  CHECK(p.bytes_sent == (n > 1 ? 24u : 0u));
  CHECK(p.bytes_received == (n > 1 ? 24u : 0u));
  // Uncounted bookkeeping leaves the counters alone.
  const CommStats quiet = comm.stats();
  CHECK(comm.all_true(true));
  CHECK(comm.stats().total().calls == quiet.total().calls);
}

}  // namespace shardlab::cases
