// failure_demo: a program that goes wrong on purpose, so the tests can show that every
// kind of failure ends the job promptly with a message and exit code 1.
//
//   --mode deadlock   every rank receives from its right neighbour; nobody sends
//   --mode throw      the last rank throws while the others wait in a barrier
//   --mode mismatch   rank 0 allreduces 8 floats, the others 6
//   --mode verify     a verification fails (the job still finishes and reports)
//   --mode shape      a matmul of mismatched shapes inside the program (exit 1, not 2)
//   --mode skip       the last rank skips an allreduce the others make (and then waits)
//   --mode busy       the last rank computes for an hour while the others allreduce
//   --mode even       needs an even number of ranks (Program::world_size): 3 is bad usage
//   --mode ok         nothing goes wrong
//   --mode throw-once the last rank throws in the first run only
//   --restarts N      run the job again, up to N times, after a rank failed (threads)
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

#include "shardlab/launch.hpp"

int main(int argc, char** argv) {
  shardlab::Program program("failure_demo", "Fails on purpose, to show how failures end a job");
  std::string mode = "ok";
  int restarts = 0;
  program.cli()
      .add_option("--mode", mode,
                  "deadlock, throw, throw-once, mismatch, verify, shape, skip, busy, even or ok")
      ->check(CLI::IsMember({"deadlock", "throw", "throw-once", "mismatch", "verify", "shape",
                             "skip", "busy", "even", "ok"}));
  program.cli()
      .add_option("--restarts", restarts, "run the job again after a failure, N times")
      ->check(CLI::Range(0, 100));
  program.restart([&](int attempt, const std::string& failure) {
    if (attempt > restarts) return false;
    std::fprintf(stderr, "failure_demo: restart %d of %d after: %s\n", attempt, restarts,
                 failure.c_str());
    return true;
  });
  program.world_size([&](const shardlab::Options&, int ranks) {
    shardlab::require_usage(
        mode != "even" || ranks % 2 == 0,
        "--mode even needs an even number of ranks, not " + std::to_string(ranks));
  });
  return program.run(argc, argv, [&](shardlab::Context& ctx) {
    auto& comm = ctx.comm();
    std::vector<float> buf(mode == "mismatch" && ctx.rank() != 0 ? 6 : 8, 1.0f);
    if (mode == "deadlock") comm.recv(buf, (ctx.rank() + 1) % ctx.size(), 7);
    const bool throws = mode == "throw" || (mode == "throw-once" && ctx.options().attempt == 0);
    if (throws && ctx.rank() == ctx.size() - 1)
      throw std::runtime_error("rank " + std::to_string(ctx.rank()) + " failed on purpose");
    if (mode == "mismatch") comm.allreduce(buf);
    if (mode == "skip") {
      if (ctx.rank() != ctx.size() - 1) comm.allreduce(buf);
      std::vector<float> never(1);
      if (ctx.rank() == ctx.size() - 1) comm.recv(never, 0, 99);  // blocked elsewhere
    }
    if (mode == "busy") {
      if (ctx.rank() == ctx.size() - 1) {  // never calls the communicator: cannot notice
        const auto end = std::chrono::steady_clock::now() + std::chrono::hours(1);
        volatile double x = 0;
        while (std::chrono::steady_clock::now() < end) x = x + 1;
      }
      comm.allreduce(buf);
    }
    if (mode == "shape") (void)shardlab::matmul(shardlab::Tensor(2, 3), shardlab::Tensor(2, 3));
    comm.barrier();
    ctx.verify(mode != "verify", "the answer was wrong on purpose");
    ctx.json()["mode"] = mode;
    ctx.json()["attempt"] = ctx.options().attempt;
    ctx.say("done");
  });
}
