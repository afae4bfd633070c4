// Chapter 08 exercise: the mesh's arithmetic, and Megatron-LM's f and g.
// Read chapters/08_hybrid_mesh/README.md first (its picture shows the 2 x 2 x 2 mesh and
// where f and g sit in a block); check your work with `make check CH=08`, and see your
// mesh with `build/learner/bin/ch08_hybrid_mesh --layout --dp 2 --tp 2 --pp 4`.
//
// Part 1, the mesh. N = pp x dp x tp ranks, in Megatron-LM's order: tp fastest, then dp,
// then pp. On a (pp, dp, tp) = (2, 2, 2) mesh rank 5 is at pp 1, dp 0, tp 1. The tests
// check your groups against Megatron-LM's documented 16-GPU example (mesh.hpp) and run
// the chapter's 3-D training on communicators made from them.
//
// Part 2, f and g. A tensor-parallel block is x -> f -> column-parallel Linear -> GELU ->
// row-parallel Linear -> g -> y. Each tp rank holds a slice of the weights: what does it
// hold of the input, of the output, and of each gradient, and what must happen so that
// every rank ends up with the whole? Useful: `tp.allreduce(t)` sums t over the tp ranks,
// in place.
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "mesh.hpp"

#include "shardlab/check.hpp"

namespace ch08 {

// TODO(ch08): coords_of
// Which stage, replica and shard is `rank`?
Coords coords_of(const MeshShape& shape, int rank) {
  (void)shape, (void)rank;
  SHARDLAB_TODO("ch08: coords_of");
}

// TODO(ch08): rank_of
int rank_of(const MeshShape& shape, const Coords& coords) {
  (void)shape, (void)coords;
  SHARDLAB_TODO("ch08: rank_of");
}

// TODO(ch08): groups
// Every group along `axis`, each in the order of its coordinate along it, the groups in
// the order of their first rank.
std::vector<std::vector<int>> groups(const MeshShape& shape, Axis axis) {
  (void)shape, (void)axis;
  SHARDLAB_TODO("ch08: groups");
}

// TODO(ch08): f_forward, f_backward, g_forward, g_backward
void f_forward(Communicator& tp, Tensor& x) {
  (void)tp, (void)x;
  SHARDLAB_TODO("ch08: f_forward");
}
void f_backward(Communicator& tp, Tensor& dx) {
  (void)tp, (void)dx;
  SHARDLAB_TODO("ch08: f_backward");
}
void g_forward(Communicator& tp, Tensor& y) {
  (void)tp, (void)y;
  SHARDLAB_TODO("ch08: g_forward");
}
void g_backward(Communicator& tp, Tensor& dy) {
  (void)tp, (void)dy;
  SHARDLAB_TODO("ch08: g_backward");
}

}  // namespace ch08
