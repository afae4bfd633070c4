// Chapter 04 API: pipeline schedules as data.
//
// A model of L layers is cut into p stages, one per rank; the batch into m microbatches.
// A schedule says, for each stage, the order in which that stage runs its operations:
//   F(j, c)  forward of microbatch j through model chunk c of this stage
//   B(j, c)  backward of microbatch j: the input gradient (and, when the schedule has no
//            W ops, the weight gradient too: the usual fused backward)
//   W(j, c)  the weight gradient of microbatch j, split off B (zero-bubble schedules)
// Chunks: with v chunks per stage (interleaved schedules) the model is cut into p * v
// pieces, and piece k = c * p + s (its "virtual stage") lives on stage s as chunk c. With
// v = 1 every stage has one chunk, c = 0.
//
// The same Schedule is printed, checked (validate), simulated (simulate.hpp) and run on
// real ranks (pipeline.hpp).
//
// The learner writes one_f_one_b in exercises/04_pipeline_bubbles/one_f_one_b.cpp; the
// reference is in solutions/04_pipeline_bubbles/.
#pragma once

#include <string>
#include <vector>

namespace ch04 {

/// What an op computes.
enum class OpKind {
  forward,   ///< F: the forward of a microbatch through a chunk
  backward,  ///< B: the input gradient (and the weight gradient when there are no W ops)
  weight     ///< W: the weight gradient, split off B
};

/// One operation of a stage: F, B or W of microbatch j through chunk c.
struct Op {
  OpKind kind;     ///< F, B or W
  int microbatch;  ///< j, 0 <= j < microbatches
  int chunk = 0;   ///< c, 0 <= c < chunks
  /// Equal when kind, microbatch and chunk all are.
  bool operator==(const Op&) const = default;
};

/// One list of ops per stage, in the order that stage runs them.
struct Schedule {
  std::string name;                  ///< its row's name in schedules()
  int stages = 1;                    ///< p
  int microbatches = 1;              ///< m: how many pieces the batch is cut into
  int chunks = 1;                    ///< v: model chunks per stage
  std::vector<std::vector<Op>> ops;  ///< ops[s]: stage s
  /// True when backwards are split into B and W ops (every B has its W).
  bool split_backward() const;
};

/// The virtual stage of chunk c on stage s: c * p + s (0 is the model's first piece).
inline int virtual_stage(int stage, int chunk, int stages) { return chunk * stages + stage; }

// ---------------------------------------------------------------------------
// The schedules

/// No microbatches: the whole batch goes forward through every stage, then backward.
/// (microbatches = 1; only one stage works at a time.)
Schedule naive(int stages);

/// GPipe (Huang et al. 2019): every forward, then every backward, on every stage.
Schedule gpipe(int stages, int microbatches);

// [exercise]
/// 1F1B, also called PipeDream-Flush (Narayanan et al. 2021, Megatron-LM's default): each
/// stage starts a microbatch's backward as soon as it can, so that stage s never holds
/// more than p - s microbatches' activations, with GPipe's bubble. THE EXERCISE.
Schedule one_f_one_b(int stages, int microbatches);
// [exercise]

/// Interleaved 1F1B (Narayanan et al. 2021 §2.2.2, Megatron-LM): v chunks per stage,
/// microbatches taken p at a time through each chunk in turn; m must be a multiple of p.
Schedule interleaved(int stages, int microbatches, int chunks);

/// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2.1): 1F1B with the
/// backward split into B and W; stage s runs, for x = 0, 1, ..., m + p - 2, the ops
/// F(x), B(x - (p - 1 - s)), W(x - (p - 1)) whose microbatch exists. The Ws fill what
/// were bubbles; at most p microbatches are in flight on any stage.
Schedule zb_h1(int stages, int microbatches);

/// The schedule called `name` (a row of schedules()), named so. UsageError for an unknown
/// name or a shape the schedule cannot take.
Schedule make_schedule(const std::string& name, int stages, int microbatches, int chunks);

/// UsageError unless a pipeline of `stages` can run `schedule` ("all": each schedule
/// the shape allows) with `microbatches` and `chunks`: what the schedule's row says it
/// cannot run; on ranks (`layers` > 0) every chunk a layer of the model; and at most a
/// million ops.
void require_shape(const std::string& schedule, int stages, int microbatches, int chunks,
                   int layers);

/// "" when `s` is a well-formed schedule, else what is wrong with it, naming the stage
/// and the op: every (microbatch, chunk) has exactly one F and one B on every stage (and
/// one W when the backward is split), after its F (and W after its B), and nothing else.
/// Whether the stages can run it together without deadlock is for simulate() to say.
std::string validate(const Schedule& s);

/// "F3", "B0", "W2" (and ".1" for chunk 1 when the schedule has more than one chunk).
std::string label(const Op& op, int chunks);

/// The schedules a run shows: `choice` alone, or with "all" every schedule the shape
/// allows (a chunked one needs, when `layers` > 0, a layer for each of its p v chunks);
/// what is left out is added to `skipped`, saying why.
std::vector<std::string> schedules_to_show(const std::string& choice, int stages, int microbatches,
                                           int chunks, int layers,
                                           std::vector<std::string>& skipped);

// ---------------------------------------------------------------------------
// What the formulas say (no communication cost; m >= 1)

/// The time one microbatch's F, B and W take on one stage (all of its chunks: one chunk's
/// op takes 1/v of it). A schedule that does not split the backward runs B + W as one op.
/// The textbook case: t_b = 2 t_f and W = 0 (the backward does twice the forward's
/// matmuls); zero-bubble papers take t_f = t_b = t_w.
struct Costs {
  double forward = 1;   ///< t_f: F
  double backward = 2;  ///< t_b: B (with W's time added when the backward is not split)
  double weight = 0;    ///< t_w: W
};

/// "t_f = 1, t_b = 2 (B and W as one op)": the costs as schedule `s` runs them.
std::string costs_text(const Schedule& s, const Costs& costs);

/// Fraction of the total time p * makespan that stages sit idle, for GPipe and 1F1B with
/// t_b = 2 t_f: (p - 1) / (m + p - 1).
double bubble_fraction_formula(int stages, int microbatches);

/// What the papers' formulas say of a schedule with these costs, where they say
/// something: the bubble over the ideal time, and the microbatches in flight per stage.
///   the naive one     p - 1                (its one op carries all m microbatches)
///   GPipe, 1F1B       (p - 1) / m          GPipe holds m on every stage, 1F1B min(p - s, m)
///   interleaved 1F1B  (p - 1) / (v m)      with t_b = 2 t_f, t_w = 0 (Megatron-LM §2.2.2)
///   ZB-H1             (p - 1) / (3 m)      with t_f = t_b = t_w and m >= p; p held
///                                          everywhere (Zero Bubble §2.1)
/// Each is its schedule's row's formula (schedules()).
struct Formula {
  std::string text;          ///< "(p-1)/m"; "" when no formula applies
  double over_ideal = -1;    ///< the bubble over the ideal time; -1: none
  std::vector<double> peak;  ///< microbatches in flight, per stage; empty: none
};
/// `batch_microbatches`: the m of the run; the naive schedule's one op carries all m, and
/// its stages hold them all (its own microbatches is 1).
Formula formula_for(const Schedule& s, const Costs& costs, int batch_microbatches);

// ---------------------------------------------------------------------------
// Every schedule, one row each

/// One schedule the chapters know. make_schedule, formula_for, schedules_to_show and
/// every program's --schedule read these rows, so a new schedule (ZB-V, DualPipe) is its
/// builder and one row of schedules() in schedules.cpp.
struct ScheduleInfo {
  const char* name;  ///< its name on every command line and in every table
  /// Builds it for stages, microbatches and chunks (one that takes no chunks ignores them).
  Schedule (*build)(int stages, int microbatches, int chunks);
  /// Its paper's formula with these costs, where one applies (Formula::text "" where not).
  Formula (*formula)(const Schedule& s, const Costs& costs, int batch_microbatches);
  bool chunked = false;      ///< it runs several model chunks per stage (--chunks)
  bool whole_batch = false;  ///< it runs the batch as one piece, not in microbatches
  /// "" when it can run `microbatches` on `stages`, else why not (one line); nullptr: any.
  std::string (*cannot)(int stages, int microbatches) = nullptr;
};
/// Every schedule, in the order the chapters show them.
const std::vector<ScheduleInfo>& schedules();
/// The row called `name`; UsageError naming every schedule when there is none.
const ScheduleInfo& schedule_info(const std::string& name);
/// The names of the schedules, in order: with `chunked` false those that run one chunk
/// per stage only, with `whole_batch` false those that cut the batch into microbatches.
std::vector<std::string> schedule_names(bool chunked = true, bool whole_batch = true);

}  // namespace ch04
