// testing: what the doctest suites of every chapter share.
//
//   check_close(got, want, atol, rtol, "what")  tensors agree, or the first mismatches
//                                               and the max diff are shown
//   for_each_world_size(body)                   body(n) as one SUBCASE per world size
//                                               1, 2, 3, 4, 8
//   on_ranks(n, body)                           body(comm) on every rank of a threads
//                                               world; an error on any rank becomes one
//                                               failed check with its message
//   run_threads(n, body)                        the same, throwing (comm_threads.hpp)
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <exception>
#include <functional>
#include <string>

#include "shardlab/comm_threads.hpp"
#include "shardlab/tensor.hpp"

namespace shardlab::testing {

/// The world sizes every distributed test sweeps, uneven ones included.
inline constexpr int world_sizes[] = {1, 2, 3, 4, 8};

/// "" when the types and shapes agree and |got - want| <= atol + rtol * |want| everywhere
/// (any floating type, host or device; NaN never agrees), else a report: the shapes, the
/// first mismatching elements (index, got, want) and the max diff.
std::string compare(const Tensor& got, const Tensor& want, float atol, float rtol);

/// A doctest check of compare(); `what` says which result this is.
inline bool check_close(const Tensor& got, const Tensor& want, float atol, float rtol,
                        const std::string& what) {
  const std::string report = compare(got, want, atol, rtol);
  CHECK_MESSAGE(report.empty(), what << ": " << report);
  return report.empty();
}

/// Bit-for-bit equality, reported like check_close.
inline bool check_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  return check_close(got, want, 0.0f, 0.0f, what);
}

/// Runs body(comm) on every rank of an n-rank threads world. An error on any rank (a
/// mismatch, an exercise stub, a deadlock that outlasted `timeout`) ends the job and the
/// test case, as one failure carrying the first rank's own message: a learner's first
/// mistake is the first thing reported, within seconds.
inline void on_ranks(int n, const std::function<void(Communicator&)>& body,
                     std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  std::string error;
  try {
    run_threads(n, body, timeout);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) FAIL(error);
}

/// Runs body(n) once per world size, each in a SUBCASE named "world size n".
inline void for_each_world_size(const std::function<void(int)>& body) {
  for (int n : world_sizes) {
    const std::string name = "world size " + std::to_string(n);
    SUBCASE(name.c_str()) { body(n); }
  }
}

}  // namespace shardlab::testing
