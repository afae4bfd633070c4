// Chapter 08 exercise, part 2: f and g, the two ends of a tensor-parallel block
// (tensor_parallel.hpp says what each must leave in its tensor). Check your work with
// `make check CH=08`.
//
// Draw a Megatron MLP block on two tp ranks,
//   x -> f -> column-parallel Linear -> GELU -> row-parallel Linear -> g -> y,
// and beside each arrow, forward and backward, write what each rank holds there: the same
// tensor as the other rank, or a piece of its own (a slice? a partial sum?). f and g stand
// where that changes. For each of the four functions: is the tensor it is given already
// what the header says it returns? If not, how do the ranks' tensors make it?
// The collectives a communicator offers are in common/include/shardlab/comm.hpp.
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
