// Errors, in one place: what goes wrong, and which exit code each becomes.
//
//   UsageError        bad input from the command line             -> exit 2
//   Error             the program itself went wrong: a shape mismatch inside a layer,
//                     a communication call with a bad peer or count -> exit 1
//   CommError         a communication call failed or hung (comm.hpp) -> exit 1
//   NotImplemented    an exercise stub that is still a stub          -> exit 1
//
// require(condition, message) is for the second kind: code that calls a function wrongly.
// require_usage(condition, message) is for the first: a flag the user gave.
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

namespace shardlab {

/// Bad input from the command line (a flag out of range, a shape that cannot be split
/// over the ranks asked for): exit code 2, one line.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A function was called wrongly or met an impossible state (a shape mismatch inside a
/// layer, a peer that does not exist): exit code 1, with the message.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// An exercise body that has not been written yet (thrown by SHARDLAB_TODO).
struct NotImplemented : std::logic_error {
  using std::logic_error::logic_error;
};

/// Throws Error(message) unless `condition` holds.
inline void require(bool condition, const std::string& message) {
  if (!condition) throw Error(message);
}
/// The same with the message built only when the check fails, for the checks every
/// operation passes through: require(ok, [&] { return "..." + t.describe(); }).
template <class Message>
requires std::is_invocable_r_v<std::string, Message>
inline void require(bool condition, Message&& message) {
  if (!condition) throw Error(message());
}

/// Throws UsageError(message) unless `condition` holds: for checks of what the user typed.
inline void require_usage(bool condition, const std::string& message) {
  if (!condition) throw UsageError(message);
}

}  // namespace shardlab

/// Marks an exercise body for the learner to write. It throws, so a test fails loudly
/// instead of comparing garbage: `SHARDLAB_TODO("ch01: data_parallel_matmul")`.
#define SHARDLAB_TODO(what)                                                            \
  throw ::shardlab::NotImplemented(std::string("TODO(") + (what) +                     \
                                   ") is not written yet: open the exercise file and " \
                                   "fill it in (" __FILE__ ")")
