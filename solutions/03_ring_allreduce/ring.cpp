// Chapter 03, reference solution: the ring's two halves.
// N ranks, r = this rank; chunk c = shard_range(S, N, c).
#include "ring_allreduce.hpp"
#include "shardlab/tensor.hpp"

namespace ch03 {

void ring_reduce_scatter(Communicator& comm, std::span<float> data, Workspace& scratch) {
  const int N = comm.size(), r = comm.rank();
  const int right = wrap(r + 1, N), left = wrap(r - 1, N);
  // Room for the incoming chunk (chunk 0 is the largest).
  const std::span<float> incoming = scratch.get(chunk(data, N, 0).size());
  for (int s = 0; s < N - 1; ++s) {
    // Pass my partial sum of one chunk on; take the left neighbour's of the next.
    const std::span<float> out = chunk(data, N, wrap(r - s, N));
    const std::span<float> mine = chunk(data, N, wrap(r - s - 1, N));
    const std::span<float> in = incoming.first(mine.size());
    comm.sendrecv(out, right, in, left, /*tag=*/s);
    for (std::size_t i = 0; i < mine.size(); ++i) mine[i] += in[i];
  }
}

void ring_allgather(Communicator& comm, std::span<float> data) {
  const int N = comm.size(), r = comm.rank();
  const int right = wrap(r + 1, N), left = wrap(r - 1, N);
  for (int s = 0; s < N - 1; ++s) {
    // Pass a finished chunk on; the one from the left lands straight in place.
    comm.sendrecv(chunk(data, N, wrap(r + 1 - s, N)), right, chunk(data, N, wrap(r - s, N)), left,
                  /*tag=*/N + s);
  }
}

}  // namespace ch03
