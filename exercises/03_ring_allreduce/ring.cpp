// Chapter 03 exercise: the ring's two halves, on sendrecv alone.
// Read chapters/03_ring_allreduce/README.md first (its diagram walks 4 ranks through
// every step); check your work with `make check CH=03`.
//
// The goal: an allreduce (sum) that sends only 2(N-1)/N of the buffer per rank. The N
// ranks stand in a circle; each sends only to its right neighbour (r + 1) and receives
// only from its left neighbour (r - 1), both mod N. Every rank's buffer is cut into N
// chunks, and every step moves one chunk per rank, so all N links are busy at once.
//
// Names: N = comm.size() ranks, r = comm.rank(), S = data.size() floats.
// Useful (ring_allreduce.hpp):
//   chunk(data, N, c)   chunk c of the buffer, a span (chunk c = shard_range(S, N, c):
//                       sizes differ by at most one element, and are 0 when S < N)
//   wrap(x, N)          x mod N in 0..N-1, also for negative x
//   owned_chunk(r, N)   the chunk rank r holds complete after the reduce-scatter
//   comm.sendrecv(out, right, in, left, tag)
//                       sends `out` and receives into `in` at once, so that a whole
//                       ring sending at the same moment cannot deadlock; both ends of
//                       a message must use the same tag
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "ring_allreduce.hpp"
#include "shardlab/check.hpp"
#include "shardlab/tensor.hpp"

namespace ch03 {

// TODO(ch03): ring_reduce_scatter
// Goal: afterwards chunk owned_chunk(r, N) of `data` holds the sum of that chunk over all
// N ranks. (The other chunks hold partial sums; the all-gather overwrites them.)
//
// N - 1 steps (none when N = 1). In every step each rank sends one chunk to the right
// and receives one chunk from the left, which it adds into its own copy of that chunk.
// Invariant: after step s, the chunk a rank has just added into holds the sum of s + 2
// ranks' contributions: its own and those of the s + 1 ranks to its left. (So after the
// last step, s = N - 2, it holds all N.)
//
// Receives: `data`, this rank's S floats, reduced in place. `scratch`, a workspace the
// caller owns and keeps between calls: scratch.get(n) lends n floats (contents
// undefined) - room for the incoming chunk, which cannot land in your own chunk before
// it is added. Do not allocate buffers of your own.
// Returns nothing; the tests check every message you send, and which ranks'
// contributions the completed chunk holds.
void ring_reduce_scatter(Communicator& comm, std::span<float> data, Workspace& scratch) {
  (void)comm, (void)data, (void)scratch;
  SHARDLAB_TODO("ch03: ring_reduce_scatter");
}

// TODO(ch03): ring_allgather
// Goal: afterwards every chunk of `data` holds the sum over all N ranks, on every rank.
//
// Starts from `data` as ring_reduce_scatter leaves it: chunk owned_chunk(r, N) is
// complete, the others hold partial sums that are to be overwritten.
// N - 1 steps (none when N = 1). In every step each rank sends one complete chunk to the
// right and receives one complete chunk from the left, straight into its place in
// `data`: no scratch, nothing to add.
// Invariant: after step s, every rank holds s + 2 complete chunks: the one it completed
// in the reduce-scatter and the s + 1 it has received.
// Returns nothing.
void ring_allgather(Communicator& comm, std::span<float> data) {
  (void)comm, (void)data;
  SHARDLAB_TODO("ch03: ring_allgather");
}

}  // namespace ch03
