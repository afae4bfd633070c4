// Chapter 10 exercise: the online softmax's merge and the zigzag assignment
// (chapters/10_ring_attention/ring_attention.hpp says what each must do).
//
// `make check CH=10` runs the tests: the merge against one pass over all the keys, in
// every order and with rows that have seen nothing; the zigzag against the causal work
// each rank gets.
#include "ring_attention.hpp"
#include "shardlab/check.hpp"

namespace ch10 {

// TODO(ch10): merge
void merge(Partial& into, const Partial& other) {
  // Each row and head: a running maximum, and both sides' sums and outputs brought to it.
  (void)into;
  (void)other;
  SHARDLAB_TODO("ch10: merge");
}

// TODO(ch10): zigzag_chunks
std::vector<int> zigzag_chunks(int cp, int rank) {
  // Two of the 2 cp chunks, so that every rank does the same causal work.
  (void)cp;
  (void)rank;
  SHARDLAB_TODO("ch10: zigzag_chunks");
}

}  // namespace ch10
