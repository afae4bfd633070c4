// What chapter 07's all-to-alls move, by formula; the pairwise all-to-all written from
// send/recv; and the benchmark's cases (moe.hpp).
#include <functional>
#include <memory>

#include "moe.hpp"
#include "shardlab/bench.hpp"
#include "shardlab/check.hpp"

using namespace shardlab;

namespace ch07 {

std::uint64_t formula_alltoall_bytes(const std::vector<Routing>& routings, int rank, int ranks,
                                     int hidden) {
  const int per = routings.front().experts / ranks;
  std::uint64_t rows = 0;
  for (int q = 0; q < ranks; ++q) {
    const Routing& r = routings[idx(q)];
    for (int c = 0; c < r.tokens * r.k; ++c) {
      if (r.slot[idx(c)] < 0) continue;  // dropped: travels nowhere
      const int owner = r.expert[idx(c)] / per;
      // Rank q's token to another rank's expert: received by that rank in the dispatch
      // and by q in the combine.
      if (owner != q && (owner == rank || q == rank)) ++rows;
    }
  }
  const auto counts = static_cast<std::uint64_t>((ranks - 1) * per) * 8;
  return 2 * rows * static_cast<std::uint64_t>(hidden) * 4 + counts;
}

double even_router_alltoall_bytes(const MoeConfig& c, int ranks) {
  const double N = ranks;
  return 4.0 * c.k * (c.tokens / N) * (N - 1.0) / N * c.hidden * 4 +
         (N - 1.0) * (c.experts / N) * 8;
}

void pairwise_alltoallv(Communicator& comm, const Tensor& in,
                        std::span<const std::size_t> send_counts, Tensor& out,
                        std::span<const std::size_t> recv_counts) {
  const int N = comm.size(), r = comm.rank();
  auto offsets = [&](std::span<const std::size_t> counts) {
    std::vector<std::int64_t> o(idx(N + 1), 0);
    for (std::size_t q = 0; q < counts.size() && q < idx(N); ++q)
      o[q + 1] = o[q] + static_cast<std::int64_t>(counts[q]);
    return o;
  };
  const std::vector<std::int64_t> send_at = offsets(send_counts), recv_at = offsets(recv_counts);
  require(send_counts.size() == idx(N) && recv_counts.size() == idx(N) &&
              send_at.back() == in.size() && recv_at.back() == out.size() &&
              send_counts[idx(r)] == recv_counts[idx(r)],
          [&] {
            return "pairwise_alltoallv on rank " + std::to_string(r) + " of " + std::to_string(N) +
                   ": counts for " + std::to_string(send_counts.size()) + " and " +
                   std::to_string(recv_counts.size()) + " ranks, summing to " +
                   std::to_string(send_at.back()) + " and " + std::to_string(recv_at.back()) +
                   ", for " + in.describe() + " in and " + out.describe() + " out";
          });
  const Tensor src = in.flat();
  Tensor dst = out.flat();
  auto block = [](const Tensor& t, const std::vector<std::int64_t>& starts, int q) {
    return t.slice(starts[idx(q)], starts[idx(q + 1)] - starts[idx(q)]);
  };
  block(dst, recv_at, r).copy_from(block(src, send_at, r));
  // Step s: send to rank r + s, receive from r - s; every rank pairs up with two others.
  for (int s = 1; s < N; ++s) {
    const int to = (r + s) % N, from = (r - s + N) % N;
    Tensor into = block(dst, recv_at, from);
    comm.sendrecv(block(src, send_at, to), to, into, from, 70 + s);
  }
}

std::vector<bench::Case> alltoall_cases(Communicator& comm, Memory memory) {
  struct Buffers {
    Tensor in, out;
    std::vector<std::size_t> counts;  // elements per peer
  };
  auto b = std::make_shared<Buffers>();
  const int N = comm.size(), r = comm.rank();
  auto prepare = [b, N, r, memory](std::int64_t count) {
    const std::int64_t block = count / N;
    b->counts.assign(idx(N), static_cast<std::size_t>(block));
    Tensor h(block * N);
    for (std::int64_t i = 0; i < h.size(); ++i) h[i] = static_cast<float>(r * 1000003 + i);
    b->in = h.to(memory);
    b->out = Tensor(h.shape(), DType::f32, memory);
  };
  auto wrong_after = [b, N, r](const std::function<void()>& exchange) {
    b->out.zero();
    exchange();
    const Tensor got = b->out.to(Memory::host);
    const std::int64_t block = got.size() / N;
    std::uint64_t bad = 0;
    for (int q = 0; q < N; ++q)
      for (std::int64_t i = 0; i < block; ++i)
        bad += got[q * block + i] != static_cast<float>(q * 1000003 + r * block + i);
    return bad;
  };
  std::function<void()> native = [b, &comm] { comm.alltoall(b->in, b->out); };
  std::function<void()> pairwise = [b, &comm] {
    pairwise_alltoallv(comm, b->in, b->counts, b->out, b->counts);
  };
  const double bus = (N - 1.0) / N;
  return {{std::string(comm.backend()) + "_alltoall", prepare, native,
           [=] { return wrong_after(native); }, bus},
          {"pairwise", prepare, pairwise, [=] { return wrong_after(pairwise); }, bus}};
}

}  // namespace ch07
