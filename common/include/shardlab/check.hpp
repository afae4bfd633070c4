// Errors, in one place: what a chapter throws, and how each becomes an exit code.
//
//   UsageError        bad input from the command line       -> exit 2
//   VerificationError a distributed result is wrong          -> exit 1
//   CommError         a communication call failed or hung    -> exit 1
//   NotImplemented    an exercise stub that is still a stub  -> exit 1
#pragma once

#include <stdexcept>
#include <string>

namespace shardlab {

/// Bad input (a flag out of range, a shape that cannot be split): exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A result that disagrees with its reference: exit code 1.
struct VerificationError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// An exercise body that has not been written yet (thrown by SHARDLAB_TODO).
struct NotImplemented : std::logic_error {
  using std::logic_error::logic_error;
};

/// Throws UsageError(message) unless `condition` holds.
inline void require(bool condition, const std::string& message) {
  if (!condition) throw UsageError(message);
}

}  // namespace shardlab

/// Marks an exercise body for the learner to write. It throws, so a test fails loudly
/// instead of comparing garbage: `SHARDLAB_TODO("ch01: data_parallel_matmul")`.
#define SHARDLAB_TODO(what)                                                            \
  throw ::shardlab::NotImplemented(std::string("TODO(") + (what) +                     \
                                   ") is not written yet: open the exercise file and " \
                                   "fill it in (" __FILE__ ")")
