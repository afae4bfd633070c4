// Chapter 11: checkpoints in memory, each rank's kept by the rank and by a peer on another
// host (--memory-checkpoints; Gemini, Wang et al., SOSP 2023).
//
// Reading a checkpoint back from storage is a large part of a restart; the machines that
// did not fail still hold their own state in memory. Gemini keeps every rank's checkpoint
// in its own host's memory and a copy in a peer host's, so that after a failure each rank
// goes on from its own memory, and a rank whose host was lost (its memory with it) gets
// its state from the peer's copy, over the network; storage only when a rank and its
// peer are both lost. Here the peer of rank r is rank (r + n/2) mod n: on the other host of
// scripts/cluster.sh's two (ranks by slot), the half of the ranks that share no host with r.
//
// Simplified: the ranks are threads of one process, and a kill forgets what the killed
// rank's memory held (its own state, and the copy it kept for its peer), as its host's
// failure would; the copies travel as messages between the ranks. Processes restarted
// under mpirun lose their memory with them (Gemini keeps it in an agent on each machine
// that outlives the training processes): --memory-checkpoints is for threads.
#pragma once

#include <string>

#include "checkpoint.hpp"
#include "train.hpp"

namespace ch11 {

/// Before the first attempt: no memory checkpoints, for `ranks` ranks.
void clear_memory(int ranks);

/// Keeps this rank's state after `step` steps (its weights, Adam's moments and step count,
/// the loss scale, the experts' alike) in its memory, and sends a copy to its peer, which
/// keeps it; receives the copy of the rank it is the peer of. Every rank calls it.
/// Returns the bytes this rank sent.
std::int64_t keep_in_memory(shardlab::Communicator& world, ch09::GptModel& model,
                            ch09::Trainer& trainer, int step);

/// Rank `rank`'s host has failed: what its memory held is gone (its own state, and the
/// copy it kept for its peer). Called by that rank.
void lose_memory(int rank);

/// Restores every rank from memory (its own, or its peer's copy, sent to it) when each
/// rank's state of the same, newest step survives somewhere on the same number of ranks;
/// returns that step and says in `how` where each came from, or -1 (every rank the same):
/// load from storage instead. Every rank calls it.
int restore_from_memory(shardlab::Communicator& world, ch09::GptModel& model,
                        ch09::Trainer& trainer, std::string& how);

}  // namespace ch11
