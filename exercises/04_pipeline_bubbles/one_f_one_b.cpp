// Chapter 04 exercise: the 1F1B pipeline schedule.
// Read chapters/04_pipeline_bubbles/README.md first (its timelines show GPipe and 1F1B
// side by side); check your work with `make check CH=04`, and watch your schedule run
// with `build/learner/bin/ch04_pipeline_bubbles --simulate --schedule 1f1b`.
//
// The goal: a schedule as fast as GPipe's (the same bubble) that keeps far fewer
// microbatches' activations alive. GPipe runs all m forwards before any backward, so
// every stage holds m microbatches' activations at once. 1F1B starts each microbatch's
// backward as early as it can, so that stage s never holds more than p - s of them.
//
// Names: p = stages, m = microbatches, s = a stage (0 is the first, p - 1 the last).
// Useful (schedule.hpp):
//   Schedule s{"1f1b", p, m, 1, {}};       a schedule of p stages, m microbatches, 1 chunk
//   s.ops.resize(p);                        one list of ops per stage
//   s.ops[st].push_back({OpKind::forward, j});   F of microbatch j on stage st
//   s.ops[st].push_back({OpKind::backward, j});  B of microbatch j
//
// What must hold, on every stage:
//   - every microbatch goes forward once and backward once, its forward first;
//   - microbatches go forward in order 0, 1, ..., m - 1, and backward in the same order;
//   - the number in flight (forwards done minus backwards done) never exceeds p - s;
//   - the stages can run it together: a backward of microbatch j on stage s needs the
//     backward of j on stage s + 1 first, and a forward on stage s + 1 needs the forward
//     on stage s. The tests run your schedule on real ranks.
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "schedule.hpp"
#include "shardlab/check.hpp"

namespace ch04 {

// TODO(ch04): one_f_one_b
// Returns the 1F1B schedule of `stages` stages and `microbatches` microbatches. Each
// stage's list has three parts: a warm-up of forwards only, a steady state in which
// forward and backward alternate, and a cool-down of backwards only. How long is each
// part on stage s?
Schedule one_f_one_b(int stages, int microbatches) {
  (void)stages, (void)microbatches;
  SHARDLAB_TODO("ch04: one_f_one_b");
}

}  // namespace ch04
