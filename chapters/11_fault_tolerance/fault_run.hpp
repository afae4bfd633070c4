// Chapter 11: a run of chapter 09's GPT through the failures it is given — each struck on
// its rank at its step, noticed, named and recovered — and what it did, attempt by attempt.
// The program (main.cpp) reads the flags; this is one attempt of the run on every rank.
#pragma once

#include <string>
#include <vector>

#include "faults.hpp"
#include "options.hpp"

namespace shardlab {
class Context;
}

namespace ch11 {

/// The run's settings: chapter 09's, and the failures'.
struct Settings11 {
  ch09::Settings run;               ///< the model, the mesh and the training (chapter 09's flags)
  std::vector<std::string> inject;  ///< --inject; none given: the last rank killed halfway
  int every = 4;                    ///< --checkpoint-every (0: none; auto: set after step 0)
  bool every_auto = false;          ///< --checkpoint-every auto: at Young's interval
  double mtbf_steps = 0;            ///< --mtbf-steps: failures drawn at this mean gap
  int check_every = 1;              ///< --check-every: the replicas' checksums
  std::string dir;                  ///< --checkpoint-dir; "": a temporary folder of the run's own
  std::string compare;              ///< --compare-flights: the records of a job to compare
  bool plan = false;                ///< --plan: the planner, on paper
  bool elastic = false;             ///< --elastic: go on with the ranks that remain
  std::string save;                 ///< --save: the final checkpoint
  bool async = false;               ///< --async-checkpoints: written in the background
  bool memory = false;              ///< --memory-checkpoints: kept in memory, and by a peer
  int processes = 0;                ///< --processes: supervise N processes under mpirun
  std::string mpirun = "mpirun";    ///< --mpirun: the command that starts them
  /// --attempt (hidden): this job is attempt K of a supervised run (--processes), its
  /// record kept in the run's folder (run_folder) for the next; -1: not supervised.
  int attempt = -1;
  bool sweep = false;  ///< --sweep: the waste against the checkpoint interval
  std::vector<int> intervals = {1, 2, 3, 4, 6, 8, 12};  ///< --intervals: the sweep's
  int rounds = 3;                                       ///< --rounds: the sweep's runs each
  std::vector<Fault> faults;  ///< the failures of --inject and --mtbf-steps, by step
};

/// Once the flags are read, for a run of `ranks` ranks: the checkpoint interval from
/// --checkpoint-every's `every` (a whole number of steps, or auto; UsageError otherwise),
/// and the faults, --inject's (the last rank killed halfway when none is given) and those
/// drawn from --mtbf-steps and `seed`, by step, on the run's first mesh (`first_ranks`, a
/// supervised attempt's --first-ranks; 0: `ranks`). The sweep's are its own: none here.
void settle_faults(Settings11& s, const std::string& every, int ranks, int first_ranks,
                   std::uint64_t seed);

/// Before the first attempt: `faults` failures, none struck yet (a failure strikes once,
/// not again when its step is trained again after a restart).
void arm_faults(std::size_t faults);

/// One attempt of the run on this rank (the first, or a restart: Context's
/// Options::attempt): the steps from the last checkpoint with this rank's faults, then the
/// attempts' goodput, the stragglers, and the final checkpoint against the reference run.
/// Every rank calls it.
void train_through_failures(shardlab::Context& ctx, Settings11 s);

/// The failure that ended the last attempt, for its row of the attempts' table.
void note_failure(const std::string& failure);

/// The most ranks below `now` that the mesh's other axes and the batch allow (--elastic);
/// 0: none.
int fewer_ranks(const Settings11& s, int now);

/// Removes the run's temporary checkpoint folder (when --checkpoint-dir was not given).
void remove_temporary();

/// A supervised run's record beside its checkpoints (DIR.run/): each attempt's
/// (attempt-K.json, rank 0's, rewritten at every step: a process may be killed at any
/// moment), and each fault that struck (struck-I, written by its rank before it acts,
/// holding what happened), so that the next attempt, in new processes, knows.
std::string run_folder(const Settings11& s);

/// What the faults that struck since the last call said (the text of the last struck-I
/// not `seen` yet; `seen` updated), or "" when none struck.
std::string last_struck(const Settings11& s, std::vector<char>& seen);

/// The supervisor's word on how attempt s.attempt ended, into its record.
void note_supervised_failure(const Settings11& s, const std::string& failure);

}  // namespace ch11
