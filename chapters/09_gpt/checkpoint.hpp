// Chapter 09's checkpoints, in the files Hugging Face's transformers reads (a sharded
// checkpoint, one file per pipeline stage, as save_pretrained writes a large model's):
//
//   DIR/model-00001-of-0000P.safetensors   pipeline stage s's whole tensors, GPT-2's names
//   ...                                    and layout (transformer.wte.weight,
//                                          transformer.h.0.attn.c_attn.weight as Conv1D's
//                                          [in, out], c_attn's columns [q | k | v], biases
//                                          and LayerNorms 1-D; the LM head is wte, tied, so
//                                          it is not written: GPT2LMHeadModel ties it)
//   DIR/model.safetensors.index.json       which file holds each tensor, and the total size
//   DIR/config.json                        GPT2Config: n_embd, n_layer, n_head, n_positions,
//                                          vocab_size, activation "gelu_new", dropouts 0
//   DIR/optimizer-0000s-of-0000P.safetensors and optimizer.safetensors.index.json
//                                          Adam's exp_avg.NAME and exp_avg_sq.NAME, alike
//   DIR/trainer.json                       the step (which is also the data's position:
//                                          batches are a function of the seed and the step),
//                                          Adam's step count, and the loss scaler's scale
//                                          and growth tracker
//
// GPT2LMHeadModel.from_pretrained(DIR) loads it and computes the same loss on the same
// bytes (hf_check.py).
//
// A model with experts (GptShape::experts) is no GPT-2: its MoE blocks' MLPs are saved as
//   transformer.h.B.mlp.router.weight        C x E, [in, out]
//   transformer.h.B.mlp.experts.e.c_fc.*     expert e's first Linear, C x 4C and 4C
//   transformer.h.B.mlp.experts.e.c_proj.*   its second, 4C x C and C
// each expert whole, whichever ep rank held it, in the same stage files; config.json has
// model_type "shardlab_moe_gpt2" (transformers' AutoModel does not take it for a GPT-2)
// and num_local_experts, num_experts_per_tok, router_aux_loss_coef (Hugging Face's
// Mixtral names), moe_layer_freq (Megatron-LM's) and expert_capacity_factor. It loads into
// a model with the same experts on any mesh; a dense model refuses it, and a MoE model a
// dense checkpoint, each in one line. A save goes in three moves, every rank taking part:
//   1. each rank writes its shard, DIR.partial/ranks/rank-R.safetensors: the first of its
//      replicas (dp x ep x cp) its pieces of the parameters (pieces_of says which), and
//      Adam's m and v as the rank keeps them (that replica all of its pieces'; under ZeRO-1
//      every replica its range);
//   2. the first rank of each pipeline stage (dp, ep, cp and tp 0) reads its stage's rank
//      files and writes the stage's whole tensors, in Hugging Face's layout;
//   3. rank 0 writes the indexes, config.json and trainer.json, removes the rank files,
//      and renames DIR.partial to DIR.
// A save that dies half-way leaves the old DIR whole (and perhaps a DIR.partial, which the
// next save replaces). Loading reads the whole tensors on every rank and cuts each rank's
// pieces out, so a checkpoint of one mesh loads into any other (train on 2 x 2 x 2, resume
// on 1 x 1 x 1), with or without ZeRO-1.
#pragma once

#include <map>
#include <string>

#include "gpt.hpp"
#include "train.hpp"

namespace ch09 {

/// UsageError unless `dir` may be written as a checkpoint: nothing there yet, an empty
/// folder, or an earlier checkpoint of this chapter (a folder with its trainer.json and
/// config.json), which the save replaces, in a folder this process may write. Anything
/// else is never touched.
void check_save_target(const std::string& dir);
/// Writes the checkpoint of step `step` (the steps done), after check_save_target. Every
/// rank calls it.
/// `experts`: the experts' optimizer (Trainer::expert_optimizer), with a MoE model.
void save_checkpoint(const std::string& dir, Mesh& mesh, GptModel& model,
                     const ch08::ReplicaOptimizer* optimizer, int step,
                     const ch06::LossScaler* scaler = nullptr,
                     const ch08::ReplicaOptimizer* experts = nullptr);

/// What save_checkpoint writes for one rank, taken apart from the writing, for a save that
/// goes on in the background while the training goes on (chapter 11's asynchronous
/// checkpoints): this rank's shard in host memory, and what the files need to know.
struct CheckpointSnapshot {
  std::map<std::string, Tensor> shard;  ///< this rank's file: values, exp_avg, exp_avg_sq
  bool lead = false;       ///< it holds its stage's dense weights: it assembles the stage
  MeshShape mesh;          ///< the mesh it was saved on
  ch08::Coords coords;     ///< this rank's place in it
  GptShape model;          ///< the model's shape (config.json)
  int chunks = 1;          ///< the model's pipeline chunks
  int states = 1;          ///< 1: the weights; 3: and Adam's m and v
  bool sharded = false;    ///< m and v sharded over the replicas (ZeRO-1)
  int step = 0;            ///< the steps done
  int adam_steps = 0;      ///< Adam's step count
  bool scaled = false;     ///< a loss scaler's state is kept
  double loss_scale = 0;   ///< its scale
  int growth_tracker = 0;  ///< and its growth tracker
};
/// This rank's part of the checkpoint of step `step`, in host memory: copies (`copy`), or,
/// where they are on the host already, the tensors themselves (for a save that ends before
/// training goes on). No communication.
CheckpointSnapshot snapshot_checkpoint(Mesh& mesh, GptModel& model,
                                       const ch08::ReplicaOptimizer* optimizer, int step,
                                       const ch06::LossScaler* scaler = nullptr,
                                       const ch08::ReplicaOptimizer* experts = nullptr,
                                       bool copy = true);
/// Writes the ranks' snapshots as the checkpoint in `dir` (after check_save_target), in
/// the three moves above; every rank of `world` calls it, from any one thread of the rank:
/// a communicator of its own for a save in the background.
void write_checkpoint(const std::string& dir, Communicator& world, const CheckpointSnapshot& c);
/// Loads DIR into this rank's model (and Adam's state, when `optimizer` keeps one, and the
/// experts' into `experts`); returns the step to go on from. UsageError (exit 2) for a
/// folder that is not such a checkpoint, a model of another shape (a MoE checkpoint into a
/// dense model included, and the other way round), or a corrupt file. Every rank calls it.
int load_checkpoint(const std::string& dir, GptModel& model, ch08::ReplicaOptimizer* optimizer,
                    ch06::LossScaler* scaler = nullptr, ch08::ReplicaOptimizer* experts = nullptr);
/// The Mixture-of-Experts settings of the checkpoint in `dir` (its config.json: experts,
/// experts a token, layer frequency, capacity factor, aux loss weight) into `shape`, for a
/// program that takes its model from there (--sample); nothing if there is none to read
/// (load_checkpoint says why).
void read_expert_config(const std::string& dir, GptShape& shape);

/// The safetensors format (Hugging Face): an 8-byte little-endian header length, a JSON
/// header naming each tensor's dtype, shape and byte range, then the data. F32 only.
void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors);
/// UsageError naming the file and what is wrong with it.
std::map<std::string, Tensor> read_safetensors(const std::string& path);

/// c_attn's columns (weight C x 3C or bias 1 x 3C) from this model's layout (each head's q,
/// k, v side by side) to GPT-2's ([q of every head | k | v]), and back.
Tensor qkv_to_hf(const Tensor& ours, std::int64_t heads);
/// qkv_to_hf's inverse: GPT-2's columns [q | k | v] back to this model's layout.
Tensor qkv_from_hf(const Tensor& hf, std::int64_t heads);

}  // namespace ch09
