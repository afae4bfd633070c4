// Chapter 03 exercise: the ring's two halves, on sendrecv alone.
// Read chapters/03_ring_allreduce/README.md first; check with `make check CH=03`.
//
// N = comm.size() ranks, r = comm.rank(). The buffer is cut into N chunks:
// chunk c = shard_range(S, N, c) (uneven when N does not divide S, empty when S < N).
// Neighbours: right = (r + 1) % N, left = (r - 1 + N) % N.
//
// Useful (ring_allreduce.hpp): wrap(x, N) is x mod N, also for negative x;
// chunk(data, N, c) is chunk c of data; comm.sendrecv(out_span, right, in_span, left,
// tag) sends and receives at once (no deadlock around a ring).
#include "ring_allreduce.hpp"
#include "shardlab/check.hpp"
#include "shardlab/tensor.hpp"

namespace ch03 {

// TODO(ch03): ring_reduce_scatter
// N-1 steps. At step s = 0, 1, ..., N-2:
//   1. send chunk (r - s) mod N to the right,
//   2. receive the left neighbour's chunk (r - s - 1) mod N into a scratch buffer
//      (scratch.get(n) lends n floats; do 1 and 2 with one sendrecv; use the step as the
//      tag),
//   3. add the scratch buffer into your own chunk (r - s - 1) mod N.
// After the last step, chunk (r + 1) mod N holds the sum over all ranks.
// Hint: the chunk you add to at step s is the chunk you send at step s + 1.
void ring_reduce_scatter(Communicator& comm, std::span<float> data, Workspace& scratch) {
  (void)comm, (void)data, (void)scratch;
  SHARDLAB_TODO("ch03: ring_reduce_scatter");
}

// TODO(ch03): ring_allgather
// N-1 steps, after ring_reduce_scatter. At step s = 0, 1, ..., N-2:
//   send chunk (r + 1 - s) mod N to the right and receive chunk (r - s) mod N from the
//   left straight into data (one sendrecv; tag N + s). Nothing to add: the chunks
//   arriving are already complete sums.
void ring_allgather(Communicator& comm, std::span<float> data) {
  (void)comm, (void)data;
  SHARDLAB_TODO("ch03: ring_allgather");
}

}  // namespace ch03
