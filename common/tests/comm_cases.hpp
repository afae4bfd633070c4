// Communicator behaviour every backend must show. Each case runs on every rank of
// `comm` (threads: run_threads; MPI: the world under mpirun) and checks with doctest.
//
// Every output element is compared, on every rank, for every element type, against a
// reference computed here from the inputs' formula (never from another collective).
// Inputs are small integers, so sums are exact in every type and every summation order,
// and results compare bit for bit; a value from the wrong rank or the wrong place differs.
// One case (reductions_add_in_rank_order) chooses data whose sum shows the order.
//
// Wrong versions this suite was checked against (each planted in the library, one at a
// time; the case that caught it is named):
//   alltoall dropping the last element of each block      alltoall_every_type
//   reduce merging only rank 0's contribution             reduce_and_broadcast_every_root
//   reduce_scatter returning the wrong rank's block       reduce_scatter_uneven_shards
//   allgatherv with its counts shifted by one rank        allgather_and_gather
//   a sub-communicator with its ranks in the wrong order  split_orders_by_key_and_nests
//   counters computed from the formula, not the copies    counters_measure_what_moved
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/half.hpp"
#include "shardlab/tensor.hpp"

namespace shardlab::cases {

// ---------------------------------------------------------------------------
// Values and references

/// Rank r's element i: a small positive integer (1..13), different across ranks and
/// positions. Sums over 8 ranks stay below 128: exact in u8, bf16 and every other type.
inline double pattern(int rank, std::size_t i) {
  return static_cast<double>((static_cast<std::size_t>(rank) * 7 + i * 3) % 13 + 1);
}

template <class T>
T to(double v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
    return from_float<T>(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <class T>
std::vector<T> rank_data(int rank, std::size_t n, std::size_t offset = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = to<T>(pattern(rank, offset + i));
  return v;
}

/// op over ranks 0..N-1 of pattern(r, i), rounded the way every backend rounds it: sums
/// are exact; avg divides in the type (integers truncate; f16/bf16 divide in f32).
template <class T>
T reduced(ReduceOp op, int N, std::size_t i) {
  double sum = 0, hi = -1e300, lo = 1e300;
  for (int r = 0; r < N; ++r) {
    sum += pattern(r, i);
    hi = std::max(hi, pattern(r, i));
    lo = std::min(lo, pattern(r, i));
  }
  switch (op) {
    case ReduceOp::sum:
      return to<T>(sum);
    case ReduceOp::max:
      return to<T>(hi);
    case ReduceOp::min:
      return to<T>(lo);
    case ReduceOp::avg:
      break;
  }
  if constexpr (std::is_integral_v<T>)
    return static_cast<T>(static_cast<std::int64_t>(sum) / N);
  else if constexpr (std::is_same_v<T, double>)
    return sum / N;
  else
    return to<T>(static_cast<double>(static_cast<float>(sum) / static_cast<float>(N)));
}

template <class T>
bool bits_equal(T a, T b) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
    return a.bits == b.bits;
  else
    return a == b;
}

/// Every element of got equals want; else one failure naming the rank, what, how many
/// differ and the first few (index, got, expected).
template <class T>
bool same(const std::vector<T>& got, const std::vector<T>& want, const std::string& what,
          int rank) {
  if (got.size() != want.size()) {
    FAIL_CHECK("rank " << rank << ": " << what << ": " << got.size() << " elements, expected "
                       << want.size());
    return false;
  }
  std::size_t bad = 0;
  std::string first;
  auto shown = [](double v) {  // every digit that tells two floats apart
    char text[32];
    std::snprintf(text, sizeof text, "%.9g", v);
    return std::string(text);
  };
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (bits_equal(got[i], want[i])) continue;
    if (++bad <= 3)
      first += " [" + std::to_string(i) + "] got " + shown(to_double(got[i])) + ", expected " +
               shown(to_double(want[i])) + ";";
  }
  if (bad == 0) return true;
  FAIL_CHECK("rank " << rank << ": " << what << ": " << bad << " of " << got.size()
                     << " elements differ:" << first);
  return false;
}

/// Calls f(T{}) for every element type a communicator moves, with the type's name captured.
template <class F>
void for_each_type(F&& f) {
  auto one = [&](auto zero) {
    const std::string name(dtype_name(dtype_of<decltype(zero)>()));
    CAPTURE(name);
    f(zero);
  };
  one(float{});
  one(double{});
  one(Half{});
  one(BFloat16{});
  one(std::int32_t{});
  one(std::int64_t{});
  one(std::uint8_t{});
}

/// Counts that cover the edge cases: 0, fewer than N, not divisible by N, divisible.
inline std::vector<std::size_t> interesting_counts(int n) {
  const auto N = static_cast<std::size_t>(n);
  return {0, 1, N > 1 ? N - 1 : 1, N, 7 * N + 3, 1000};
}

inline std::size_t shard_of(std::size_t count, int n, int r) {
  return static_cast<std::size_t>(shard_range(static_cast<std::int64_t>(count), n, r).length);
}

// ---------------------------------------------------------------------------
// Collectives

inline void allreduce_every_op_and_type(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  for_each_type([&](auto zero) {
    using T = decltype(zero);
    for (std::size_t count : interesting_counts(n))
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
        std::vector<T> buf = rank_data<T>(r, count), want(count);
        for (std::size_t i = 0; i < count; ++i) want[i] = reduced<T>(op, n, i);
        comm.allreduce(buf, op);
        same(buf, want,
             "allreduce " + std::string(reduce_op_name(op)) + " of " + std::to_string(count), r);
      }
  });
}

inline void max_and_min_propagate_nan(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  for (ReduceOp op : {ReduceOp::max, ReduceOp::min}) {
    std::vector<float> buf(4, static_cast<float>(r));
    if (r == n - 1) buf[2] = std::numeric_limits<float>::quiet_NaN();
    comm.allreduce(buf, op);
    CHECK_MESSAGE(std::isnan(buf[2]), "rank " << r << ": " << reduce_op_name(op)
                                              << " dropped the NaN of rank " << n - 1);
    CHECK(buf[0] == static_cast<float>(op == ReduceOp::max ? n - 1 : 0));
  }
  CHECK(std::isnan(comm.agree(r == 0 ? std::nan("") : 1.0, ReduceOp::max)));
}

inline void reduce_and_broadcast_every_root(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  for_each_type([&](auto zero) {
    using T = decltype(zero);
    const std::size_t count = 7 * static_cast<std::size_t>(n) + 3;
    for (int root = 0; root < n; ++root)
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
        std::vector<T> buf = rank_data<T>(r, count), want = buf;
        if (r == root)
          for (std::size_t i = 0; i < count; ++i) want[i] = reduced<T>(op, n, i);
        comm.reduce(buf, op, root);
        same(buf, want,
             "reduce " + std::string(reduce_op_name(op)) + " to root " + std::to_string(root) +
                 (r == root ? "" : " (a non-root's buffer must not change)"),
             r);
        std::vector<T> b = r == root ? rank_data<T>(root, count) : std::vector<T>(count, to<T>(0));
        comm.broadcast(b, root);
        same(b, rank_data<T>(root, count), "broadcast from root " + std::to_string(root), r);
      }
  });
}

inline void reduce_scatter_uneven_shards(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  for_each_type([&](auto zero) {
    using T = decltype(zero);
    for (std::size_t count : interesting_counts(n))
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min}) {
        const ShardRange mine = shard_range(static_cast<std::int64_t>(count), n, r);
        const std::vector<T> in = rank_data<T>(r, count);
        std::vector<T> out(static_cast<std::size_t>(mine.length)), want(out.size());
        for (std::size_t i = 0; i < want.size(); ++i)
          want[i] = reduced<T>(op, n, static_cast<std::size_t>(mine.offset) + i);
        comm.reduce_scatter(in, out, op);
        same(out, want,
             "reduce_scatter " + std::string(reduce_op_name(op)) + " of " + std::to_string(count) +
                 ": shard " + std::to_string(r) + " = elements " + std::to_string(mine.offset) +
                 ".." + std::to_string(mine.offset + mine.length),
             r);
      }
  });
}

/// Rank q's count in the uneven gathers: 0, 1 or 2 elements, zeros included.
inline std::size_t uneven_count(int q) { return static_cast<std::size_t>((q * 5 + 1) % 3); }

/// allreduce, reduce_scatter and their non-blocking forms add in rank order, halves in
/// f32 rounded once at the end, the same bits on every backend: data whose sum shows the
/// order. f32: every rank but the last holds 2^-24, the last 1; in rank order the small
/// ones add up first (three ranks: 1 + 2^-23), any order that adds the 1 earlier gives 1.
/// f16 and bf16: rank 0 holds 1, the others half an ulp of 1 each; added in f32, three
/// ranks make 1 + an ulp, rounded at each step, 1. With two ranks every order agrees: the
/// case bites from three. Wrong versions this fails (three ranks): Open MPI's own
/// MPI_Reduce_scatter and MPI_Iallreduce (their order is their own; halves rounded after
/// each addition), the blocks added from the last rank down, halves rounded after each
/// addition in the shared reduction.
/// `blocking_allreduce`: the blocking allreduce too (not the MPI backend's: Open MPI's own,
/// in its own order).
inline void reductions_add_in_rank_order(Communicator& comm, bool blocking_allreduce = true) {
  const int n = comm.size(), r = comm.rank();
  const std::size_t count = 5 * static_cast<std::size_t>(n) + 2;
  const ShardRange mine = shard_range(static_cast<std::int64_t>(count), n, r);
  const auto length = static_cast<std::size_t>(mine.length);
  for_each_type([&](auto zero) {
    using T = decltype(zero);
    constexpr bool half = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;
    if constexpr (std::is_same_v<T, float> || half) {
      const float ulp = std::is_same_v<T, float>  ? 0x1p-23f
                        : std::is_same_v<T, Half> ? 0x1p-10f
                                                  : 0x1p-7f;
      auto value = [&](int q) {
        if constexpr (half) return q == 0 ? 1.0f : ulp / 2;
        return q == n - 1 ? 1.0f : ulp / 2;
      };
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
        float sum = 0;  // in rank order, in f32
        for (int q = 0; q < n; ++q) sum += value(q);
        if (op == ReduceOp::avg) sum /= static_cast<float>(n);
        const std::vector<T> in(count, to<T>(value(r))), want(length, to<T>(sum)),
            want_all(count, to<T>(sum));
        std::vector<T> out(length), out_nb(length), all = in, all_nb = in;
        comm.reduce_scatter(in, out, op);
        Request started = comm.ireduce_scatter(in, out_nb, op);
        comm.wait(started);
        if (blocking_allreduce) comm.allreduce(all, op);
        started = comm.iallreduce(all_nb, op);
        comm.wait(started);
        const std::string what =
            std::string(reduce_op_name(op)) + " of " + std::to_string(n) + " ranks, in rank order";
        same(out, want, "reduce_scatter " + what, r);
        same(out_nb, want, "ireduce_scatter " + what, r);
        if (blocking_allreduce) same(all, want_all, "allreduce " + what, r);
        same(all_nb, want_all, "iallreduce " + what, r);
      }
    }
  });
}

inline void allgather_and_gather(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const auto N = static_cast<std::size_t>(n);
  for_each_type([&](auto zero) {
    using T = decltype(zero);
    // allgather: rank q's 3 elements land at 3q.
    std::vector<T> all(3 * N), want;
    for (int q = 0; q < n; ++q) {
      const auto v = rank_data<T>(q, 3);
      want.insert(want.end(), v.begin(), v.end());
    }
    comm.allgather(rank_data<T>(r, 3), all);
    same(all, want, "allgather of 3 per rank", r);
    // allgatherv and gatherv: rank q contributes uneven_count(q) elements.
    std::vector<std::size_t> counts(N);
    std::vector<T> wantv;
    for (int q = 0; q < n; ++q) {
      counts[static_cast<std::size_t>(q)] = uneven_count(q);
      const auto v = rank_data<T>(q, uneven_count(q), 100);
      wantv.insert(wantv.end(), v.begin(), v.end());
    }
    std::vector<T> allv(wantv.size());
    comm.allgatherv(rank_data<T>(r, uneven_count(r), 100), allv, counts);
    same(allv, wantv, "allgatherv with counts 0/1/2 by rank", r);
    for (int root = 0; root < n; ++root) {
      std::vector<T> at_root(r == root ? wantv.size() : 0);
      comm.gatherv(rank_data<T>(r, uneven_count(r), 100), at_root, counts, root);
      if (r == root) same(at_root, wantv, "gatherv to root " + std::to_string(root), r);
    }
  });
}

/// What rank `from` sends to rank `to` in the alltoallv case: 0 to 3 elements.
inline std::size_t alltoallv_count(int from, int to) {
  return static_cast<std::size_t>((from + 2 * to) % 4);
}

inline void alltoall_every_type(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const auto N = static_cast<std::size_t>(n);
  for_each_type([&](auto zero) {
    using T = decltype(zero);
    // alltoall, blocks of 3: block j of rank q (elements 3j..3j+2 of its data) lands in
    // block q of rank j.
    const std::size_t block = 3;
    std::vector<T> out(block * N), want;
    for (int q = 0; q < n; ++q) {
      const auto v = rank_data<T>(q, block, block * static_cast<std::size_t>(r));
      want.insert(want.end(), v.begin(), v.end());
    }
    comm.alltoall(rank_data<T>(r, block * N), out);
    same(out, want, "alltoall of blocks of 3", r);
    // alltoallv: rank q sends alltoallv_count(q, j) elements to rank j, the blocks back to
    // back in its data; they arrive back to back in rank order.
    std::vector<std::size_t> send(N), recv(N);
    std::size_t sent_total = 0;
    for (int j = 0; j < n; ++j) {
      send[static_cast<std::size_t>(j)] = alltoallv_count(r, j);
      recv[static_cast<std::size_t>(j)] = alltoallv_count(j, r);
      sent_total += alltoallv_count(r, j);
    }
    std::vector<T> wantv;
    for (int q = 0; q < n; ++q) {
      std::size_t offset = 0;  // where rank q's block for me starts in its data
      for (int j = 0; j < r; ++j) offset += alltoallv_count(q, j);
      const auto v = rank_data<T>(q, alltoallv_count(q, r), offset);
      wantv.insert(wantv.end(), v.begin(), v.end());
    }
    std::vector<T> outv(wantv.size());
    comm.alltoallv(rank_data<T>(r, sent_total), send, outv, recv);
    same(outv, wantv, "alltoallv with counts (from + 2 to) % 4", r);
  });
}

inline void non_blocking_collectives(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const std::size_t count = 5 * static_cast<std::size_t>(n) + 2;
  std::vector<float> a = rank_data<float>(r, count), want_a(count);
  for (std::size_t i = 0; i < count; ++i) want_a[i] = reduced<float>(ReduceOp::sum, n, i);
  const std::vector<Half> b_in = rank_data<Half>(r, count);
  std::vector<Half> b(shard_of(count, n, r)), want_b(b.size());
  const auto b_offset =
      static_cast<std::size_t>(shard_range(static_cast<std::int64_t>(count), n, r).offset);
  for (std::size_t i = 0; i < b.size(); ++i)
    want_b[i] = reduced<Half>(ReduceOp::sum, n, b_offset + i);
  std::vector<std::int64_t> c(2 * static_cast<std::size_t>(n)), want_c;
  for (int q = 0; q < n; ++q)
    for (std::int64_t v : rank_data<std::int64_t>(q, 2)) want_c.push_back(v);
  const std::vector<std::int64_t> c_in = rank_data<std::int64_t>(r, 2);
  std::vector<std::size_t> counts(static_cast<std::size_t>(n));
  std::vector<double> want_d;
  for (int q = 0; q < n; ++q) {
    counts[static_cast<std::size_t>(q)] = uneven_count(q);
    for (double v : rank_data<double>(q, uneven_count(q))) want_d.push_back(v);
  }
  const std::vector<double> d_in = rank_data<double>(r, uneven_count(r));
  std::vector<double> d(want_d.size());
  // ialltoallv: alltoall_every_type's counts, rank q's blocks back to back.
  const auto N = static_cast<std::size_t>(n);
  std::vector<std::size_t> send(N), recv(N);
  std::size_t sent_total = 0;
  std::vector<std::int32_t> want_f;
  for (int j = 0; j < n; ++j) {
    send[static_cast<std::size_t>(j)] = alltoallv_count(r, j);
    recv[static_cast<std::size_t>(j)] = alltoallv_count(j, r);
    sent_total += alltoallv_count(r, j);
    std::size_t offset = 0;  // where rank j's block for me starts in its data
    for (int q = 0; q < r; ++q) offset += alltoallv_count(j, q);
    for (std::int32_t v : rank_data<std::int32_t>(j, alltoallv_count(j, r), offset))
      want_f.push_back(v);
  }
  const std::vector<std::int32_t> f_in = rank_data<std::int32_t>(r, sent_total);
  std::vector<std::int32_t> f(want_f.size());

  // Five collectives in flight at once, a blocking one in between, then the waits (out of
  // order).
  Request ra = comm.iallreduce(a);
  Request rb = comm.ireduce_scatter(b_in, b);
  Request rc = comm.iallgather(c_in, c);
  std::vector<float> e = rank_data<float>(r, 3), want_e(3);
  for (std::size_t i = 0; i < 3; ++i) want_e[i] = reduced<float>(ReduceOp::max, n, i);
  comm.allreduce(e, ReduceOp::max);
  Request rd = comm.iallgatherv(d_in, d, counts);
  Request rf = comm.ialltoallv(f_in, send, f, recv);
  comm.wait(rc);
  comm.wait(ra);
  Request rest[] = {std::move(rf), std::move(rb), std::move(rd)};
  comm.wait_all(rest);
  same(f, want_f, "ialltoallv of i32 with counts (from + 2 to) % 4", r);
  same(a, want_a, "iallreduce (sum)", r);
  same(b, want_b, "ireduce_scatter of f16 (uneven shards)", r);
  same(c, want_c, "iallgather of i64", r);
  same(d, want_d, "iallgatherv of f64", r);
  same(e, want_e, "a blocking allreduce between non-blocking ones", r);
}

// ---------------------------------------------------------------------------
// Point to point

inline void point_to_point_ring(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  // sendrecv around a ring cannot deadlock; every type travels.
  for_each_type([&](auto zero) {
    using T = decltype(zero);
    std::vector<T> got(5);
    comm.sendrecv(rank_data<T>(r, 5), right, got, left, 3);
    same(got, rank_data<T>(left, 5), "sendrecv from the left neighbour", r);
  });
  // Non-blocking: two messages from one rank arrive in the order they were sent, and a
  // message to oneself is delivered too.
  std::vector<float> a(2), b(2), self(3);
  Request recvs[3] = {comm.irecv(a, left, 9), comm.irecv(b, left, 10), comm.irecv(self, r, 4)};
  const std::vector<float> first = rank_data<float>(r, 2), second = rank_data<float>(r, 2, 50);
  const std::vector<float> mine = rank_data<float>(r, 3, 7);
  Request sends[3] = {comm.isend(first, right, 9), comm.isend(second, right, 10),
                      comm.isend(mine, r, 4)};
  comm.wait_all(sends);
  comm.wait_all(recvs);
  same(a, rank_data<float>(left, 2), "first isend from the left", r);
  same(b, rank_data<float>(left, 2, 50), "second isend from the left", r);
  same(self, mine, "message to oneself", r);
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
  // Tensors are buffers too, and a row slice (a view) is one.
  Tensor t = randn(4, 3, static_cast<std::uint64_t>(r + 1)), got(2, 3);
  comm.sendrecv(t.slice(1, 2), right, got, left, 5);
  const Tensor want = randn(4, 3, static_cast<std::uint64_t>(left + 1)).slice(1, 2);
  CHECK_MESSAGE(got.bitwise_equal(want), "rank " << r << ": a row slice sent as a view");
}

/// A receive that names another tag than the matched send is an error (tags are checked,
/// not used to pick messages): run it on a communicator of its own.
inline void tag_mismatch_is_an_error(Communicator& comm) {
  if (comm.size() < 2) return;
  std::string message;
  std::vector<float> x(2, 1.0f);
  if (comm.rank() == 0) {
    Request sends[2] = {comm.isend(x, 1, 1), comm.isend(x, 1, 2)};
    comm.wait_all(sends);
  } else if (comm.rank() == 1) {
    std::vector<float> y(2);
    try {
      comm.recv(y, 0, 2);  // the first message from rank 0 has tag 1
    } catch (const CommError& e) {
      message = e.what();
    }
    CHECK_MESSAGE(message.find("met rank 0's send with tag 1") != std::string::npos, message);
    comm.recv(y, 0, 2);  // the second one does have tag 2
  }
}

// ---------------------------------------------------------------------------
// Sub-communicators

/// Every collective, blocking and not, and a point-to-point ring on `sub`, in f32 and i64
/// (the other types are covered on the world above).
inline void everything_on(Communicator& sub) {
  const int n = sub.size(), r = sub.rank();
  const std::size_t count = 3 * static_cast<std::size_t>(n) + 1;
  std::vector<float> a = rank_data<float>(r, count), want(count);
  for (std::size_t i = 0; i < count; ++i) want[i] = reduced<float>(ReduceOp::sum, n, i);
  sub.allreduce(a);
  same(a, want, "allreduce on a sub-communicator", r);
  std::vector<std::int64_t> rs(shard_of(count, n, r)), want_rs(rs.size());
  const auto off =
      static_cast<std::size_t>(shard_range(static_cast<std::int64_t>(count), n, r).offset);
  for (std::size_t i = 0; i < rs.size(); ++i)
    want_rs[i] = reduced<std::int64_t>(ReduceOp::sum, n, off + i);
  sub.reduce_scatter(rank_data<std::int64_t>(r, count), rs);
  same(rs, want_rs, "reduce_scatter on a sub-communicator", r);
  std::vector<float> g(2 * static_cast<std::size_t>(n)), want_g;
  for (int q = 0; q < n; ++q)
    for (float v : rank_data<float>(q, 2)) want_g.push_back(v);
  sub.allgather(rank_data<float>(r, 2), g);
  same(g, want_g, "allgather on a sub-communicator", r);
  std::vector<float> bc = r == n - 1 ? rank_data<float>(n - 1, 4) : std::vector<float>(4);
  sub.broadcast(bc, n - 1);
  same(bc, rank_data<float>(n - 1, 4), "broadcast on a sub-communicator", r);
  std::vector<std::int64_t> red = rank_data<std::int64_t>(r, 4), want_red = red;
  if (r == 0)
    for (std::size_t i = 0; i < 4; ++i) want_red[i] = reduced<std::int64_t>(ReduceOp::max, n, i);
  sub.reduce(red, ReduceOp::max, 0);
  same(red, want_red, "reduce on a sub-communicator", r);
  std::vector<float> at(2 * static_cast<std::size_t>(n)), want_at;
  for (int q = 0; q < n; ++q)
    for (float v : rank_data<float>(q, 2, 2 * static_cast<std::size_t>(r))) want_at.push_back(v);
  sub.alltoall(rank_data<float>(r, 2 * static_cast<std::size_t>(n)), at);
  same(at, want_at, "alltoall on a sub-communicator", r);
  // The uneven and non-blocking ones.
  std::vector<std::size_t> counts(static_cast<std::size_t>(n));
  std::vector<float> want_v;
  for (int q = 0; q < n; ++q) {
    counts[static_cast<std::size_t>(q)] = uneven_count(q);
    for (float v : rank_data<float>(q, uneven_count(q), 9)) want_v.push_back(v);
  }
  std::vector<float> allv(want_v.size()), at_root(r == 0 ? want_v.size() : 0);
  sub.allgatherv(rank_data<float>(r, uneven_count(r), 9), allv, counts);
  same(allv, want_v, "allgatherv on a sub-communicator", r);
  sub.gatherv(rank_data<float>(r, uneven_count(r), 9), at_root, counts, 0);
  if (r == 0) same(at_root, want_v, "gatherv on a sub-communicator", r);
  std::vector<std::size_t> send(static_cast<std::size_t>(n)), recv(send.size());
  std::vector<float> want_a2a;
  std::size_t sent_total = 0;
  for (int j = 0; j < n; ++j) {
    send[static_cast<std::size_t>(j)] = alltoallv_count(r, j);
    recv[static_cast<std::size_t>(j)] = alltoallv_count(j, r);
    sent_total += alltoallv_count(r, j);
    std::size_t offset = 0;
    for (int k = 0; k < r; ++k) offset += alltoallv_count(j, k);
    for (float v : rank_data<float>(j, alltoallv_count(j, r), offset)) want_a2a.push_back(v);
  }
  std::vector<float> a2a(want_a2a.size());
  sub.alltoallv(rank_data<float>(r, sent_total), send, a2a, recv);
  same(a2a, want_a2a, "alltoallv on a sub-communicator", r);
  std::vector<float> nb = rank_data<float>(r, count);
  Request pending = sub.iallreduce(nb);
  sub.wait(pending);
  same(nb, want, "iallreduce on a sub-communicator", r);
  std::vector<float> got(3);
  sub.sendrecv(rank_data<float>(r, 3), (r + 1) % n, got, (r + n - 1) % n, 1);
  same(got, rank_data<float>((r + n - 1) % n, 3), "sendrecv on a sub-communicator", r);
  sub.barrier();
}

inline void split_orders_by_key_and_nests(Communicator& comm) {
  const int r = comm.rank(), n = comm.size();
  // Colors: even and odd ranks; key -rank reverses the order inside each.
  const int color = r % 2;
  auto sub = comm.split(color, -r);
  std::vector<int> members;  // parent ranks of the sub-communicator, in its rank order
  for (int q = n - 1; q >= 0; --q)
    if (q % 2 == color) members.push_back(q);
  REQUIRE(sub->size() == static_cast<int>(members.size()));
  CHECK_MESSAGE(members[static_cast<std::size_t>(sub->rank())] == r,
                "rank " << r << " is rank " << sub->rank() << " of its color " << color
                        << ", expected "
                        << std::find(members.begin(), members.end(), r) - members.begin()
                        << " (ordered by key -rank)");
  // The sub-communicator's ranks are who they say: each reports its parent rank.
  const std::vector<std::int32_t> parents = sub->gather_values(static_cast<std::int32_t>(r));
  for (std::size_t q = 0; q < members.size(); ++q)
    CHECK_MESSAGE(parents[q] == members[q], "sub rank " << q << " is parent rank " << parents[q]
                                                        << ", expected " << members[q]);
  everything_on(*sub);
  // A split of a split: halves of each color (by sub rank), ordered by sub rank.
  auto nested = sub->split(sub->rank() < (sub->size() + 1) / 2 ? 0 : 1, sub->rank());
  everything_on(*nested);
  const std::vector<std::int32_t> nested_parents =
      nested->gather_values(static_cast<std::int32_t>(r));
  for (std::size_t q = 1; q < nested_parents.size(); ++q)
    CHECK_MESSAGE(nested_parents[q] < nested_parents[q - 1],
                  "nested split: parent ranks " << nested_parents[q - 1] << ", "
                                                << nested_parents[q] << " out of key order");
  // Counters: each communicator counts its own calls; they add up.
  CHECK(sub->stats()[Op::allreduce].calls == 2);
  CHECK(nested->stats()[Op::allreduce].calls == 2);
  CommStats both = sub->stats();
  both += nested->stats();
  CHECK(both[Op::allreduce].calls == 4);
}

// ---------------------------------------------------------------------------
// Counters

/// What this rank's counters must show for one collective: the bytes of the algorithm
/// (measured on threads, modeled on MPI). Worked out here, element by element.
inline void expect_traffic(Communicator& comm, const CommStats& before, Op op, std::uint64_t sent,
                           std::uint64_t received, const std::string& what) {
  const OpStats s = comm.stats().since(before)[op];
  CHECK_MESSAGE(s.calls == 1, what << ": " << s.calls << " calls counted");
  CHECK_MESSAGE(s.bytes_sent == sent, "rank " << comm.rank() << ": " << what << " sent "
                                              << s.bytes_sent << " bytes, expected " << sent);
  CHECK_MESSAGE(s.bytes_received == received, "rank " << comm.rank() << ": " << what << " received "
                                                      << s.bytes_received << " bytes, expected "
                                                      << received);
}

inline void counters_measure_what_moved(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const auto N = static_cast<std::uint64_t>(n);
  auto chunk = [&](std::size_t count, int q) {
    return static_cast<std::uint64_t>(shard_of(count, n, q));
  };
  for (std::size_t count : {std::size_t{32} * static_cast<std::size_t>(n), std::size_t{1001}}) {
    CAPTURE(count);
    const std::uint64_t S = count;
    // allreduce: reduce my chunk (reading N-1 copies of it), then fetch the others' chunks.
    std::vector<float> buf(count, 1.0f);
    CommStats before = comm.stats();
    comm.allreduce(buf);
    const std::uint64_t ar = (n == 1 ? 0 : S + (N - 2) * chunk(count, r)) * 4;
    expect_traffic(comm, before, Op::allreduce, ar, ar, "allreduce");
    if (count % static_cast<std::size_t>(n) == 0)
      CHECK(ar == (n == 1 ? 0 : 2 * (N - 1) * S * 4 / N));  // = 2(N-1)/N S
    // reduce_scatter: hand out the others' shards of my input; take N-1 copies of mine.
    std::vector<double> shard(shard_of(count, n, r));
    before = comm.stats();
    comm.reduce_scatter(std::vector<double>(count, 1.0), shard);
    expect_traffic(comm, before, Op::reduce_scatter, (S - chunk(count, r)) * 8,
                   (N - 1) * chunk(count, r) * 8, "reduce_scatter");
    // allgatherv: my counts[r] to each of the N-1 others; everyone else's to me.
    std::vector<std::size_t> counts(static_cast<std::size_t>(n));
    std::uint64_t total = 0;
    for (int q = 0; q < n; ++q) total += counts[static_cast<std::size_t>(q)] = uneven_count(q) + 1;
    std::vector<std::int32_t> all(total);
    before = comm.stats();
    comm.allgatherv(std::vector<std::int32_t>(uneven_count(r) + 1), all, counts);
    expect_traffic(comm, before, Op::allgather, (N - 1) * (uneven_count(r) + 1) * 4,
                   (total - uneven_count(r) - 1) * 4, "allgatherv");
  }
  // alltoallv: what I send to the others, what they send to me.
  std::vector<std::size_t> send(static_cast<std::size_t>(n)), recv(static_cast<std::size_t>(n));
  std::uint64_t out = 0, in = 0;
  for (int j = 0; j < n; ++j) {
    send[static_cast<std::size_t>(j)] = alltoallv_count(r, j);
    recv[static_cast<std::size_t>(j)] = alltoallv_count(j, r);
    if (j != r) out += alltoallv_count(r, j), in += alltoallv_count(j, r);
  }
  std::vector<Half> got(std::accumulate(recv.begin(), recv.end(), std::size_t{0}));
  CommStats before = comm.stats();
  comm.alltoallv(std::vector<Half>(std::accumulate(send.begin(), send.end(), std::size_t{0})), send,
                 got, recv);
  expect_traffic(comm, before, Op::alltoall, out * 2, in * 2, "alltoallv of f16");
  // broadcast from the last rank: it sends S to each other rank.
  std::vector<float> b(10);
  before = comm.stats();
  comm.broadcast(b, n - 1);
  expect_traffic(comm, before, Op::broadcast, r == n - 1 ? (N - 1) * 40 : 0, r == n - 1 ? 0 : 40,
                 "broadcast");
  // Point to point: exactly the message, both ends; to oneself, nothing.
  before = comm.stats();
  std::vector<float> p(6);
  comm.sendrecv(std::vector<float>(6, 1.0f), (r + 1) % n, p, (r + n - 1) % n);
  expect_traffic(comm, before, Op::sendrecv, n > 1 ? 24 : 0, n > 1 ? 24 : 0, "sendrecv");
  // Whatever one rank sent, another received: the totals over ranks agree, per operation.
  for (Op op : {Op::allreduce, Op::reduce_scatter, Op::allgather, Op::alltoall, Op::broadcast}) {
    const auto sent = comm.agree<std::int64_t>(
        static_cast<std::int64_t>(comm.stats()[op].bytes_sent), ReduceOp::sum);
    const auto received = comm.agree<std::int64_t>(
        static_cast<std::int64_t>(comm.stats()[op].bytes_received), ReduceOp::sum);
    CHECK_MESSAGE(sent == received, op_name(op) << ": " << sent << " bytes sent over all ranks, "
                                                << received << " received");
  }
  // Uncounted bookkeeping leaves the counters alone.
  const CommStats quiet = comm.stats();
  CHECK(comm.all_true(true));
  CHECK(comm.stats().total().calls == quiet.total().calls);
}

}  // namespace shardlab::cases
