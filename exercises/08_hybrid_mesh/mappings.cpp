// Chapter 08 exercise, part 2: f and g, the two ends of a tensor-parallel block
// (tensor_parallel.hpp). Check your work with `make check CH=08`.
//
// A Megatron MLP block is x -> f -> column-parallel Linear -> GELU -> row-parallel Linear
// -> g -> y. Each tp rank holds a slice of the weights: what does it hold of the input,
// of the output, and of each gradient, and what must happen so that every rank ends up
// with what the next step needs? Useful: `tp.allreduce(t)` sums t over the tp ranks, in
// place.
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "shardlab/check.hpp"
#include "tensor_parallel.hpp"

namespace ch08 {

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
