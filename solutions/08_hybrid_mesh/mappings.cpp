// Chapter 08 reference, part 2: Megatron-LM's f and g (tensor_parallel.hpp; Shoeybi et al.
// 2019, Figure 3). The column-parallel layer's every rank needs all of x, which it has, and
// gives back its part of dL/dx; the row-parallel layer's every rank gives a partial sum of
// y, and dL/dy reaches each one whole, weight 1.
#include "tensor_parallel.hpp"

namespace ch08 {

void f_forward(Communicator&, Tensor&) {}
void f_backward(Communicator& tp, Tensor& dx) { tp.allreduce(dx); }
void g_forward(Communicator& tp, Tensor& y) { tp.allreduce(y); }
void g_backward(Communicator&, Tensor&) {}

}  // namespace ch08
