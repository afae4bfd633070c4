// Chapter 09's checkpoints (checkpoint.hpp).
#include "checkpoint.hpp"

#include <fcntl.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "shardlab/check.hpp"
#include "shardlab/results.hpp"

namespace ch09 {

namespace fs = std::filesystem;
using shardlab::read_file;
using shardlab::require_usage;

namespace {

/// Column permutation between the two layouts of c_attn: to_hf[ours] = hf's column.
Tensor permute_columns(const Tensor& in, std::int64_t heads, bool to_hf) {
  const std::int64_t R = in.rows(), C3 = in.cols(), C = C3 / 3, D = C / heads;
  Tensor out(R, C3);
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t p = 0; p < 3; ++p)
      for (std::int64_t d = 0; d < D; ++d) {
        const std::int64_t ours = h * 3 * D + p * D + d, hf = p * C + h * D + d;
        for (std::int64_t r = 0; r < R; ++r)
          to_hf ? out(r, hf) = in(r, ours) : out(r, ours) = in(r, hf);
      }
  return out;
}

/// The whole tensor a piece belongs to, in Hugging Face's layout, from ours.
Tensor to_hf(const Piece& p, const Tensor& ours, std::int64_t heads) {
  Tensor t = p.qkv ? qkv_to_hf(ours, heads) : ours;
  return p.whole[0] == 1 ? t.reshape(Shape{p.whole[1]}) : t;
}

/// This rank's piece of a whole tensor in Hugging Face's layout.
Tensor piece_of(const Piece& p, const Tensor& hf, std::int64_t heads) {
  Tensor t = hf.reshape(p.whole);
  if (p.qkv) t = qkv_from_hf(t, heads);
  switch (p.cut) {
    case Cut::rows:
      return t.slice(p.part.offset, p.part.length);
    case Cut::columns: {
      Tensor out(p.whole[0], p.part.length);
      for (std::int64_t r = 0; r < p.whole[0]; ++r)
        for (std::int64_t c = 0; c < p.part.length; ++c) out(r, c) = t(r, p.part.offset + c);
      return out;
    }
    case Cut::whole:
      break;
  }
  return t;
}

/// Writes a piece's data (`src`, its elements in order) into the whole tensor `dst`.
void place(const Piece& p, const float* src, Tensor& dst) {
  const std::int64_t cols = p.whole[1];
  switch (p.cut) {
    case Cut::whole:
      std::copy(src, src + p.size(), dst.data());
      break;
    case Cut::rows:
      std::copy(src, src + p.size(), dst.data() + p.part.offset * cols);
      break;
    case Cut::columns:
      for (std::int64_t r = 0; r < p.whole[0]; ++r)
        for (std::int64_t c = 0; c < p.part.length; ++c)
          dst(r, p.part.offset + c) = src[r * p.part.length + c];
      break;
  }
}

/// The MoE keys of config.json (Hugging Face's Mixtral names where it has one: the number
/// of experts, the experts a token goes to, the aux loss's weight; Megatron-LM's layer
/// frequency; Switch Transformer's capacity factor).
constexpr const char* kMoeKeys[] = {"num_local_experts", "num_experts_per_tok", "moe_layer_freq",
                                    "expert_capacity_factor", "router_aux_loss_coef"};

nlohmann::json config_json(const GptShape& s) {
  if (s.experts > 0) {  // not GPT-2: transformers' GPT-2 must not take it for one
    nlohmann::json j = config_json(GptShape{s.layers, s.channels, s.heads, s.context, s.vocab});
    j["architectures"] = {"ShardLabMoeGPT"};
    j["model_type"] = "shardlab_moe_gpt2";
    j["num_local_experts"] = s.experts;
    j["num_experts_per_tok"] = s.top_k;
    j["moe_layer_freq"] = s.moe_every;
    j["expert_capacity_factor"] = s.capacity_factor;
    j["router_aux_loss_coef"] = s.aux_alpha;
    return j;
  }
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", s.vocab},
          {"n_positions", s.context},
          {"n_ctx", s.context},
          {"n_embd", s.channels},
          {"n_layer", s.layers},
          {"n_head", s.heads},
          {"n_inner", nullptr},
          {"activation_function", "gelu_new"},
          {"resid_pdrop", 0.0},
          {"embd_pdrop", 0.0},
          {"attn_pdrop", 0.0},
          {"layer_norm_epsilon", 1e-5},
          {"initializer_range", 0.02},
          {"scale_attn_weights", true},
          {"tie_word_embeddings", true},
          {"bos_token_id", 10},
          {"eos_token_id", 10}};
}

void write_json(const fs::path& path, const nlohmann::json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  shardlab::require(out.good(), "cannot write " + path.string());
}

}  // namespace

Tensor qkv_to_hf(const Tensor& ours, std::int64_t heads) {
  return permute_columns(ours, heads, true);
}
Tensor qkv_from_hf(const Tensor& hf, std::int64_t heads) {
  return permute_columns(hf, heads, false);
}

void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors) {
  nlohmann::json header = {{"__metadata__", {{"format", "pt"}}}};
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    std::vector<std::int64_t> shape;
    for (int d = 0; d < t.ndim(); ++d) shape.push_back(t.dim(d));
    header[name] = {
        {"dtype", "F32"}, {"shape", shape}, {"data_offsets", {offset, offset + t.bytes()}}};
    offset += t.bytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t n = text.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(n));
  for (const auto& [name, t] : tensors)
    out.write(static_cast<const char*>(t.raw()), static_cast<std::streamsize>(t.bytes()));
  shardlab::require(out.good(), "cannot write " + path);
}

std::map<std::string, Tensor> read_safetensors(const std::string& path) {
  const std::string bytes = read_file(path, path);
  auto bad = [&](const std::string& why) {
    return path + " is not a safetensors file of float32 tensors: " + why;
  };
  require_usage(bytes.size() >= 8, bad("shorter than its 8-byte header length"));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  require_usage(n <= bytes.size() - 8, bad("its header is longer than the file"));
  const std::uint64_t data = 8 + n, size = bytes.size() - data;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.substr(8, n));
  } catch (const nlohmann::json::exception&) {
    require_usage(false, bad("its header is not JSON"));
  }
  require_usage(header.is_object(), bad("its header is not a JSON object"));
  std::map<std::string, Tensor> out;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      require_usage(entry.at("dtype") == "F32", bad(name + " is " + entry.at("dtype").dump()));
      const auto shape = entry.at("shape").get<std::vector<std::int64_t>>();
      const auto range = entry.at("data_offsets").get<std::vector<std::uint64_t>>();
      std::int64_t count = 1;
      for (std::int64_t d : shape) {
        require_usage(d >= 0 && d <= (1LL << 31),
                      bad(name + " has a dimension of " + std::to_string(d)));
        count *= d;
      }
      require_usage(shape.size() >= 1 && shape.size() <= 2 && range.size() == 2 &&
                        range[0] <= range[1] && range[1] <= size &&
                        range[1] - range[0] == static_cast<std::uint64_t>(count) * 4,
                    bad(name + "'s shape and byte range do not fit the file"));
      Tensor t(shape.size() == 1 ? Shape{shape[0]} : Shape{shape[0], shape[1]},
               shardlab::DType::f32);
      std::memcpy(t.raw(), bytes.data() + data + range[0], t.bytes());
      out.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception&) {
      require_usage(false, bad(name + "'s entry lacks dtype, shape or data_offsets"));
    }
  }
  return out;
}

void check_save_target(const std::string& dir) {
  const fs::path d = dir, partial = dir + ".partial", old = dir + ".old";
  require_usage(!dir.empty(), "--save is empty: name a folder");
  // The save writes DIR.partial beside DIR, then renames: the folder around must take it.
  shardlab::check_writable_folder(d.has_parent_path() ? d.parent_path() : ".", "--save");
  for (const fs::path& p : {partial, old})  // what a save makes and removes beside DIR
    require_usage(
        !fs::exists(fs::symlink_status(p)) ||
            (fs::is_directory(fs::symlink_status(p)) &&
             (fs::is_empty(p) || fs::exists(p / "trainer.json") || fs::exists(p / "ranks"))),
        "--save " + dir + ": " + p.string() +
            " is there and is not a checkpoint's: move it away first");
  if (!fs::exists(fs::symlink_status(d))) return;
  require_usage(fs::is_directory(fs::symlink_status(d)),
                "--save " + dir + ": something other than a folder is there (it is left alone)");
  require_usage(
      fs::is_empty(d) || (fs::exists(d / "trainer.json") && fs::exists(d / "config.json")),
      "--save " + dir +
          ": a folder that is not a checkpoint of this chapter is there (it is left "
          "alone): name a new folder");
}

namespace {

/// Each whole tensor of the model: the pipeline stage whose file holds it (the first stage
/// with a piece of it: wte's is stage 0, where the embedding is; the last stage's head
/// holds a copy), and its elements.
/// The two sets of weights a rank holds, each saved by the first of the ranks that hold
/// the same: the dense ones (model.store(), the same on the replicas) and the experts'
/// (model.expert_store(), the same on the expert replicas).
struct WeightSet {
  const char* prefix;                     // of its entries in a rank file: "" or "expert_"
  const std::vector<ch08::Axis>& copies;  // the axes its copies lie along
  std::vector<Piece> (*pieces)(const GptShape&, const MeshShape&, const Coords&, int);
};
const WeightSet kWeightSets[] = {{"", ch08::kReplicaAxes, &pieces_of},
                                 {"expert_", ch08::kExpertReplicaAxes, &expert_pieces_of}};

struct WholeTensor {
  int stage = 0;
  std::int64_t elements = 0;
};
std::map<std::string, WholeTensor> whole_tensors(const GptShape& g, const MeshShape& shape,
                                                 int chunks) {
  std::map<std::string, WholeTensor> out;
  for (int r = 0; r < shape.ranks(); ++r) {
    const Coords q = ch08::coords_of(shape, r);
    for (const WeightSet& set : kWeightSets)
      for (const Piece& p : set.pieces(g, shape, q, chunks)) {
        const auto [it, fresh] = out.try_emplace(p.name, WholeTensor{q.pp, p.whole.numel()});
        if (!fresh) it->second.stage = std::min(it->second.stage, q.pp);
      }
  }
  return out;
}

/// Hugging Face's names for the files of a sharded checkpoint: model-00001-of-00004.
std::string stage_file(const std::string& stem, int stage, int stages) {
  char name[64];
  std::snprintf(name, sizeof name, "%s-%05d-of-%05d.safetensors", stem.c_str(), stage + 1, stages);
  return name;
}

fs::path rank_file(const fs::path& partial, int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.safetensors", rank);
  return partial / "ranks" / name;
}

std::int64_t pieces_size(const std::vector<Piece>& pieces) {
  std::int64_t n = 0;
  for (const Piece& p : pieces) n += p.size();
  return n;
}

/// Stage s's whole tensors, from the rank files of its ranks, written in Hugging Face's
/// layout: the values to model-(s+1)-of-P, Adam's state (`states` 3) to optimizer-(s+1)-of-P.
/// `sharded`: each replica wrote its own range of m and v (ZeRO-1), not the first all of it.
void assemble_stage(const fs::path& partial, const MeshShape& shape, const GptShape& g, int chunks,
                    int s, int states, bool sharded) {
  const std::map<std::string, WholeTensor> owner = whole_tensors(g, shape, chunks);
  std::map<int, std::map<std::string, Tensor>> files;  // rank -> its file, read once
  auto file = [&](int r) -> std::map<std::string, Tensor>& {
    auto it = files.find(r);
    if (it == files.end()) it = files.emplace(r, read_safetensors(rank_file(partial, r))).first;
    return it->second;
  };
  std::map<std::string, Tensor> whole[3];  // values, exp_avg, exp_avg_sq: our layout
  std::map<std::string, Piece> kind_of;
  const char* state_names[3] = {"values", "exp_avg", "exp_avg_sq"};
  for (const WeightSet& set : kWeightSets)
    for (int r = 0; r < shape.ranks(); ++r) {
      const Coords q = ch08::coords_of(shape, r);
      const std::vector<int> copies = ch08::group_along(shape, q, set.copies);
      const std::vector<Piece> pieces = set.pieces(g, shape, q, chunks);
      if (q.pp != s || copies.front() != r || pieces.empty()) continue;
      const std::int64_t n = pieces_size(pieces);
      const auto R = static_cast<int>(copies.size());
      for (int k = 0; k < states; ++k) {
        // This rank's flat buffer of state k: its own file's, or (ZeRO-1's m and v) each
        // copy's range of it.
        const std::string entry = set.prefix + std::string(state_names[k]);
        Tensor flat(shardlab::Shape{n}, shardlab::DType::f32);
        for (int d = 0; d < (k > 0 && sharded ? R : 1); ++d) {
          const int from = copies[static_cast<std::size_t>(d)];
          const shardlab::ShardRange range =
              k > 0 && sharded ? shardlab::shard_range(n, R, d) : shardlab::ShardRange{0, n};
          const auto it = file(from).find(entry);
          shardlab::require(it != file(from).end() && it->second.size() == range.length,
                            "save: rank " + std::to_string(from) + "'s " + entry +
                                " is missing or of the wrong size");
          flat.slice(range.offset, range.length).copy_from(it->second);
        }
        const float* at = flat.data();
        for (const Piece& p : pieces) {
          if (owner.at(p.name).stage == s && (p.counted || p.cut != Cut::whole)) {
            auto w = whole[k].try_emplace(p.name, Tensor(p.whole[0], p.whole[1])).first;
            place(p, at, w->second);
            kind_of.try_emplace(p.name, p);
          }
          at += p.size();
        }
      }
    }
  const char* prefix[3] = {"", "exp_avg.", "exp_avg_sq."};
  std::map<std::string, Tensor> out[2];
  for (int k = 0; k < states; ++k)
    for (const auto& [name, t] : whole[k])
      out[k ? 1 : 0][prefix[k] + name] = to_hf(kind_of.at(name), t, g.heads);
  write_safetensors((partial / stage_file("model", s, shape.pp)).string(), out[0]);
  if (states == 3)
    write_safetensors((partial / stage_file("optimizer", s, shape.pp)).string(), out[1]);
}

/// Hugging Face's index of a sharded checkpoint: which file holds each tensor, under each
/// of `prefixes` (Adam's exp_avg. and exp_avg_sq.; "" for the model), and the bytes of all.
nlohmann::json index_json(const GptShape& g, const MeshShape& shape, int chunks,
                          const std::string& stem, const std::vector<std::string>& prefixes) {
  nlohmann::json map = nlohmann::json::object();
  std::uint64_t bytes = 0;
  for (const auto& [name, t] : whole_tensors(g, shape, chunks))
    for (const std::string& prefix : prefixes) {
      map[prefix + name] = stage_file(stem, t.stage, shape.pp);
      bytes += 4 * static_cast<std::uint64_t>(t.elements);
    }
  return {{"metadata", {{"total_size", bytes}}}, {"weight_map", map}};
}

/// The tensors of DIR/STEM.safetensors, or of the files DIR/STEM.safetensors.index.json
/// names (a sharded checkpoint), as Hugging Face looks for them.
std::map<std::string, Tensor> read_tensors(const fs::path& d, const std::string& stem) {
  const fs::path index = d / (stem + ".safetensors.index.json");
  if (!fs::exists(index)) return read_safetensors((d / (stem + ".safetensors")).string());
  nlohmann::json j;
  const std::string text = read_file(index, index.string());
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    require_usage(false, index.string() + " is not JSON");
  }
  const nlohmann::json map = j.is_object() ? j.value("weight_map", nlohmann::json()) : j;
  require_usage(map.is_object(), index.string() + " has no weight_map");
  std::set<std::string> names;
  for (const auto& [name, file] : map.items()) {
    require_usage(file.is_string() && file.get<std::string>().find('/') == std::string::npos &&
                      file.get<std::string>() != "..",
                  index.string() + ": " + name + "'s file is not a file name in the folder");
    names.insert(file.get<std::string>());
  }
  std::map<std::string, Tensor> out;
  for (const std::string& name : names) out.merge(read_safetensors((d / name).string()));
  return out;
}

// Each tensor's FNV-1a of its bytes, kept in trainer.json: a load checks that the values
// are the ones saved, which a shape cannot tell for a square matrix transposed.
constexpr const char* kChecksums = "model_fnv1a64";

nlohmann::json checksums(const std::map<std::string, Tensor>& tensors) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, t] : tensors) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(shardlab::fnv1a64(t.raw(), t.bytes())));
    out[name] = hex;
  }
  return out;
}

}  // namespace

namespace {

/// What step 1 of a save writes for this rank, copied to host memory: of each set of
/// weights, the first of the ranks that hold the same its pieces' values, and Adam's m and
/// v as this rank keeps them (that rank all of them; under ZeRO-1 every copy its range).
/// `lead`: whether it holds the dense weights (its stage's files are then its to assemble).
std::map<std::string, Tensor> shard_of(Mesh& mesh, GptModel& model,
                                       const ch08::ReplicaOptimizer* optimizer,
                                       const ch08::ReplicaOptimizer* experts, int states, bool copy,
                                       bool& lead) {
  std::map<std::string, Tensor> mine;
  lead = false;
  for (const WeightSet& set : kWeightSets) {
    const bool dense = std::string(set.prefix).empty();
    const ch08::ReplicaOptimizer* o = dense ? optimizer : experts;
    nn::ParameterStore& store = dense ? model.store() : model.expert_store();
    if (!dense && model.expert_pieces().empty()) continue;
    const ch08::ReplicaOptimizer::State st = o ? o->state() : ch08::ReplicaOptimizer::State{};
    const bool first =
        ch08::group_along(mesh.shape(), mesh.coords(), set.copies).front() == mesh.world().rank();
    if (dense) lead = first;
    const std::string prefix = set.prefix;
    // `copy`: copies (to() of a host tensor shares it), for training to go on while they
    // are written.
    auto host = [copy](const Tensor& t) {
      Tensor h = t.to(Memory::host);
      return copy && h.raw() == t.raw() ? h.clone() : h;
    };
    if (first) mine.emplace(prefix + "values", host(store.values()));
    if (states == 3 && (first || !st.every_replica)) {
      mine.emplace(prefix + "exp_avg", host(st.m));
      mine.emplace(prefix + "exp_avg_sq", host(st.v));
    }
  }
  return mine;
}

/// Step 3 of a save, on rank 0: the indexes, config.json and trainer.json into DIR.partial,
/// then DIR.partial becomes DIR.
void finish_save(const fs::path& partial, const fs::path& final_dir, const CheckpointSnapshot& c) {
  const GptShape& g = c.model;
  fs::remove_all(partial / "ranks");
  write_json(partial / "model.safetensors.index.json",
             index_json(g, c.mesh, c.chunks, "model", {""}));
  if (c.states == 3)
    write_json(partial / "optimizer.safetensors.index.json",
               index_json(g, c.mesh, c.chunks, "optimizer", {"exp_avg.", "exp_avg_sq."}));
  write_json(partial / "config.json", config_json(g));
  nlohmann::json trainer = {{"step", c.step}, {"adam_steps", c.adam_steps}, {"seed", g.seed}};
  trainer[kChecksums] = checksums(read_tensors(partial, "model"));
  if (c.scaled) {
    trainer["loss_scale"] = c.loss_scale;
    trainer["growth_tracker"] = c.growth_tracker;
  }
  write_json(partial / "trainer.json", trainer);
  // The new folder and the old swap names in one step (renameat2's RENAME_EXCHANGE), so a
  // save killed at any moment leaves DIR a whole checkpoint, the old one or the new. Where
  // the filesystem cannot swap, the old one moves aside to DIR.old first.
  if (fs::exists(final_dir) &&
      ::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(partial);  // the old checkpoint, now
    return;
  }
  const fs::path old = final_dir.string() + ".old";
  fs::remove_all(old);
  if (fs::exists(final_dir)) fs::rename(final_dir, old);
  fs::rename(partial, final_dir);
  fs::remove_all(old);
}

}  // namespace

CheckpointSnapshot snapshot_checkpoint(Mesh& mesh, GptModel& model,
                                       const ch08::ReplicaOptimizer* optimizer, int step,
                                       const ch06::LossScaler* scaler,
                                       const ch08::ReplicaOptimizer* experts, bool copy) {
  CheckpointSnapshot c;
  const ch08::ReplicaOptimizer::State state =
      optimizer ? optimizer->state() : ch08::ReplicaOptimizer::State{};
  c.states = state.m.defined() ? 3 : 1;
  c.sharded = c.states == 3 && !state.every_replica;
  c.adam_steps = state.steps;
  c.shard = shard_of(mesh, model, optimizer, experts, c.states, copy, c.lead);
  c.mesh = mesh.shape();
  c.coords = mesh.coords();
  c.model = model.shape();
  c.chunks = model.chunks();
  c.step = step;
  if (scaler && scaler->kind() != ch06::Scaler::none) {
    c.scaled = true;
    c.loss_scale = scaler->scale();
    c.growth_tracker = scaler->dynamic().growth_tracker();
  }
  return c;
}

void write_checkpoint(const std::string& dir, Communicator& world, const CheckpointSnapshot& c) {
  Communicator::Uncounted not_counted(world);
  const fs::path partial = dir + ".partial";
  // 0. Every rank is here (one that died before the save leaves nothing behind); rank 0
  //    makes the scratch folder.
  world.barrier();
  if (world.rank() == 0) {
    check_save_target(dir);  // again: it may have changed since the run began
    fs::remove_all(partial);
    fs::create_directories(partial / "ranks");
  }
  world.barrier();
  // 1. Each rank writes its shard.
  if (!c.shard.empty()) write_safetensors(rank_file(partial, world.rank()).string(), c.shard);
  world.barrier();
  // 2. The first rank of each pipeline stage assembles the stage's whole tensors.
  if (c.lead && c.coords.tp == 0)
    assemble_stage(partial, c.mesh, c.model, c.chunks, c.coords.pp, c.states, c.sharded);
  world.barrier();
  // 3. Rank 0 writes the indexes and the rest, and only now does DIR change.
  if (world.rank() == 0) finish_save(partial, dir, c);
  world.barrier();
}

void save_checkpoint(const std::string& dir, Mesh& mesh, GptModel& model,
                     const ch08::ReplicaOptimizer* optimizer, int step,
                     const ch06::LossScaler* scaler, const ch08::ReplicaOptimizer* experts) {
  write_checkpoint(dir, mesh.world(),
                   snapshot_checkpoint(mesh, model, optimizer, step, scaler, experts, false));
}

void read_expert_config(const std::string& dir, GptShape& shape) {
  const fs::path path = fs::path(dir) / "config.json";
  std::error_code error;
  if (!fs::is_regular_file(path, error)) return;  // load_checkpoint says what is wrong
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path, path.string()));
  } catch (const std::exception&) {
    return;
  }
  if (!j.is_object() || !j.value("num_local_experts", nlohmann::json(0)).is_number_integer())
    return;
  auto number = [&](const char* key, auto fallback) {
    const nlohmann::json x = j.value(key, nlohmann::json());
    return x.is_number() ? x.get<decltype(fallback)>() : fallback;
  };
  shape.experts = number("num_local_experts", 0);
  shape.top_k = number("num_experts_per_tok", shape.top_k);
  shape.moe_every = number("moe_layer_freq", shape.moe_every);
  shape.capacity_factor = number("expert_capacity_factor", shape.capacity_factor);
  shape.aux_alpha = number("router_aux_loss_coef", shape.aux_alpha);
}

namespace {

/// One --load of DIR: its files and its checks, every message "--load DIR: ...".
class Loading {
 public:
  explicit Loading(std::string dir) : d_(dir), dir_(std::move(dir)) {
    need(fs::is_directory(d_), "no such folder");
  }
  /// UsageError "--load DIR: what" unless `ok`.
  void need(bool ok, const std::string& what) const {
    require_usage(ok, "--load " + dir_ + ": " + what);
  }
  /// The JSON object in `file`.
  nlohmann::json json_file(const char* file) const {
    need(fs::exists(d_ / file), std::string("no ") + file + " (not a checkpoint of this chapter)");
    const std::string text = read_file(d_ / file, "--load " + dir_ + ": " + file);
    nlohmann::json out;
    try {
      out = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception&) {
      need(false, std::string(file) + " is not JSON");
    }
    need(out.is_object(), std::string(file) + " is not a JSON object");
    return out;
  }
  /// `file`'s `key`: absent (0), or a whole number from 0 to 2^31 - 1.
  int whole_number(const nlohmann::json& j, const char* file, const char* key) const {
    if (!j.contains(key)) return 0;
    const nlohmann::json& x = j[key];
    need(x.is_number_integer() && x.get<std::int64_t>() >= 0 &&
             x.get<std::int64_t>() <= std::numeric_limits<int>::max(),
         std::string(file) + "'s " + key + " is " + x.dump() +
             ", not a whole number from 0 to 2^31 - 1");
    return static_cast<int>(x.get<std::int64_t>());
  }
  /// The whole tensors of `what` ("model" or "optimizer").
  std::map<std::string, Tensor> tensors(const char* what) const { return read_tensors(d_, what); }
  /// The folder, as given.
  const std::string& dir() const { return dir_; }

 private:
  fs::path d_;
  std::string dir_;
};

/// config.json against the model `g`: its sizes, and its experts (a Mixture-of-Experts
/// checkpoint and a dense model, or the other way round, are two models: said so, not
/// loaded half).
void check_config(const Loading& load, const nlohmann::json& config, const GptShape& g) {
  const nlohmann::json want = config_json(g);
  for (const char* key : {"n_layer", "n_embd", "n_head", "n_positions", "vocab_size"})
    load.need(config.value(key, nlohmann::json()) == want[key],
              std::string("the checkpoint's ") + key + " is " +
                  config.value(key, nlohmann::json()).dump() + ", this model's " +
                  want[key].dump() + " (give the same --layers --channels --heads --context)");
  const nlohmann::json experts = config.value("num_local_experts", nlohmann::json(0));
  load.need(
      experts.is_number_integer() && experts.get<std::int64_t>() >= 0,
      "config.json's num_local_experts is " + experts.dump() + ", not a whole number of experts");
  GptShape stored = g;
  stored.experts = 0;
  read_expert_config(load.dir(), stored);
  load.need(g.experts > 0 || stored.experts == 0,
            "a Mixture-of-Experts model (" + describe_experts(stored) +
                "): a dense model cannot take it; give " + experts_flags(stored));
  load.need(g.experts == 0 || stored.experts > 0,
            "a dense GPT-2, without experts: leave out --experts");
  if (g.experts > 0)
    for (const char* key : kMoeKeys)
      load.need(config.value(key, nlohmann::json()) == want[key],
                std::string("the checkpoint's ") + key + " is " +
                    config.value(key, nlohmann::json()).dump() + ", this model's " +
                    want[key].dump() + " (give " + experts_flags(stored) + ")");
}

/// The values must be the ones saved, where trainer.json says what they were (a checkpoint
/// written elsewhere, without it, loads as it is).
void check_checksums(const Loading& load, const nlohmann::json& trainer,
                     const std::map<std::string, Tensor>& tensors) {
  if (!trainer.contains(kChecksums)) return;
  const nlohmann::json& saved = trainer[kChecksums];
  load.need(saved.is_object(),
            std::string("trainer.json's ") + kChecksums + " is not a JSON object");
  const nlohmann::json now = checksums(tensors);
  for (const auto& [name, sum] : saved.items())  // a missing one: "no NAME" below
    load.need(!now.contains(name) || now[name] == sum,
              name + " is not the tensor saved with it (its FNV-1a differs from trainer.json's: " +
                  "transposed, or changed; remove " + kChecksums +
                  " from trainer.json to load it anyway)");
}

/// One store's pieces cut out of the whole tensors into it, and (with `adam`) Adam's m and
/// v from `state` to optimizer `o`.
void load_store(const Loading& load, nn::ParameterStore& store, const std::vector<Piece>& pieces,
                std::int64_t heads, const std::map<std::string, Tensor>& tensors,
                const std::map<std::string, Tensor>& state, ch08::ReplicaOptimizer* o,
                int adam_steps) {
  const std::vector<nn::Parameter*> params = store.parameters();
  const std::int64_t P = store.size();
  Tensor m(shardlab::Shape{P}, shardlab::DType::f32), v(shardlab::Shape{P}, shardlab::DType::f32);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Piece& p = pieces[i];
    // Hugging Face's shape of the tensor: a bias (1 x n here) is a vector there.
    const shardlab::Shape want =
        p.whole.ndim() == 2 && p.whole[0] == 1 ? shardlab::Shape{p.whole[1]} : p.whole;
    auto take = [&](const std::map<std::string, Tensor>& from, const std::string& name) {
      const auto it = from.find(name);
      load.need(it != from.end(), "no " + name);
      load.need(it->second.shape() == want, name + " is " + it->second.shape().str() +
                                                ", this model's is " + want.str() +
                                                " (transposed, or another model)");
      load.need(shardlab::all_finite(it->second), name + " holds NaN or infinite values");
      return piece_of(p, it->second, heads);
    };
    params[i]->value.copy_from(take(tensors, p.name).reshape(params[i]->value.shape()));
    if (!o) continue;
    m.slice(params[i]->offset, p.size()).copy_from(take(state, "exp_avg." + p.name).flat());
    v.slice(params[i]->offset, p.size()).copy_from(take(state, "exp_avg_sq." + p.name).flat());
  }
  if (o) o->restore(m, v, adam_steps);
}

/// A scaler's state, where both the checkpoint and this run have one.
void load_scaler(const Loading& load, const nlohmann::json& trainer, ch06::LossScaler* scaler) {
  if (!scaler || scaler->kind() == ch06::Scaler::none || !trainer.contains("loss_scale")) return;
  load.need(trainer["loss_scale"].is_number(), "trainer.json's loss_scale is not a number");
  const double scale = trainer["loss_scale"].get<double>();
  const int tracker = load.whole_number(trainer, "trainer.json", "growth_tracker");
  load.need(scale > 0 && scale <= 3.4e38 && tracker >= 0 &&
                tracker < scaler->dynamic().config().growth_interval,
            "trainer.json's loss_scale or growth_tracker is out of range");
  scaler->restore(static_cast<float>(scale), tracker);
}

}  // namespace

int load_checkpoint(const std::string& dir, GptModel& model, ch08::ReplicaOptimizer* optimizer,
                    ch06::LossScaler* scaler, ch08::ReplicaOptimizer* experts) {
  const Loading load(dir);
  const nlohmann::json config = load.json_file("config.json"),
                       trainer = load.json_file("trainer.json");
  check_config(load, config, model.shape());
  const std::map<std::string, Tensor> tensors = load.tensors("model");
  check_checksums(load, trainer, tensors);
  const bool adam = optimizer && optimizer->state().m.defined();
  const std::map<std::string, Tensor> state =
      adam ? load.tensors("optimizer") : std::map<std::string, Tensor>{};
  const int adam_steps = load.whole_number(trainer, "trainer.json", "adam_steps");
  load_store(load, model.store(), model.pieces(), model.shape().heads, tensors, state,
             adam ? optimizer : nullptr, adam_steps);
  load_store(load, model.expert_store(), model.expert_pieces(), model.shape().heads, tensors, state,
             adam ? experts : nullptr, adam_steps);
  load_scaler(load, trainer, scaler);
  return load.whole_number(trainer, "trainer.json", "step");
}

}  // namespace ch09
