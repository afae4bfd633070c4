// Chapter 09's checkpoints (checkpoint.hpp).
#include "checkpoint.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "shardlab/check.hpp"

namespace ch09 {

namespace fs = std::filesystem;
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

nlohmann::json config_json(const GptShape& s) {
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
  std::ifstream in(path, std::ios::binary);
  require_usage(in.good(), path + ": cannot read it");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
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
  for (const fs::path& p : {partial, old})  // what a save makes and removes beside DIR
    require_usage(
        !fs::exists(fs::symlink_status(p)) || (fs::is_directory(fs::symlink_status(p)) &&
                                               (fs::is_empty(p) || fs::exists(p / "trainer.json"))),
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

void save_checkpoint(const std::string& dir, Mesh& mesh, GptModel& model, const nn::Adam* adam,
                     int step) {
  if (mesh.world().rank() == 0) check_save_target(dir);  // again: it may have changed
  // Every piece of replica 0 (values, then Adam's m and v) to world rank 0.
  Communicator& world = mesh.world();
  const MeshShape& shape = mesh.shape();
  const GptShape& g = model.shape();
  const int states = adam ? 3 : 1;
  Tensor mine(shardlab::Shape{mesh.coords().dp == 0 ? states * model.store().size() : 0},
              shardlab::DType::f32);
  if (mesh.coords().dp == 0) {
    mine.slice(0, model.store().size()).copy_from(model.store().values());
    if (adam) {
      mine.slice(model.store().size(), model.store().size()).copy_from(adam->m());
      mine.slice(2 * model.store().size(), model.store().size()).copy_from(adam->v());
    }
  }
  std::vector<std::size_t> counts;
  std::vector<std::vector<Piece>> every;
  for (int r = 0; r < world.size(); ++r) {
    const Coords q = ch08::coords_of(shape, r);
    every.push_back(pieces_of(g, shape, q, model.chunks()));
    std::int64_t n = 0;
    for (const Piece& p : every.back()) n += p.size();
    counts.push_back(q.dp == 0 ? static_cast<std::size_t>(states * n) : 0);
  }
  std::size_t total = 0;
  for (std::size_t n : counts) total += n;
  Tensor all(shardlab::Shape{world.rank() == 0 ? static_cast<std::int64_t>(total) : 0},
             shardlab::DType::f32);
  {
    Communicator::Uncounted quiet(world);
    world.gatherv(mine, all, counts, 0);
  }
  if (world.rank() == 0) {
    std::map<std::string, Tensor> whole[3];  // values, exp_avg, exp_avg_sq: ours
    std::map<std::string, const Piece*> kind;
    const float* src = all.data();
    for (int r = 0; r < world.size(); ++r) {
      if (!counts[static_cast<std::size_t>(r)]) continue;
      std::int64_t n = 0;
      for (const Piece& p : every[static_cast<std::size_t>(r)]) n += p.size();
      for (int k = 0; k < states; ++k) {
        const float* at = src + k * n;
        for (const Piece& p : every[static_cast<std::size_t>(r)]) {
          if (p.counted || p.cut != Cut::whole) {
            auto it = whole[k].try_emplace(p.name, Tensor(p.whole[0], p.whole[1])).first;
            place(p, at, it->second);
            kind[p.name] = &p;
          }
          at += p.size();
        }
      }
      src += states * n;
    }
    const fs::path partial = dir + ".partial", final_dir = dir, old = dir + ".old";
    fs::remove_all(partial);
    fs::create_directories(partial);
    const char* prefix[3] = {"", "exp_avg.", "exp_avg_sq."};
    std::map<std::string, Tensor> files[2];
    for (int k = 0; k < states; ++k)
      for (const auto& [name, t] : whole[k])
        files[k ? 1 : 0][prefix[k] + name] = to_hf(*kind[name], t, g.heads);
    write_safetensors((partial / "model.safetensors").string(), files[0]);
    if (adam) write_safetensors((partial / "optimizer.safetensors").string(), files[1]);
    write_json(partial / "config.json", config_json(g));
    write_json(partial / "trainer.json",
               {{"step", step}, {"adam_steps", adam ? adam->steps() : 0}, {"seed", g.seed}});
    // Only now does DIR change: the old one moves aside, the new one takes its name.
    fs::remove_all(old);
    if (fs::exists(final_dir)) fs::rename(final_dir, old);
    fs::rename(partial, final_dir);
    fs::remove_all(old);
  }
  Communicator::Uncounted quiet(world);
  world.barrier();
}

int load_checkpoint(const std::string& dir, Mesh& mesh, GptModel& model, nn::Adam* adam) {
  const fs::path d = dir;
  const GptShape& g = model.shape();
  require_usage(fs::is_directory(d), "--load " + dir + ": no such folder");
  nlohmann::json config, trainer;
  for (auto [file, into] :
       {std::pair{"config.json", &config}, std::pair{"trainer.json", &trainer}}) {
    std::ifstream in(d / file);
    require_usage(in.good(),
                  "--load " + dir + ": no " + file + " (not a checkpoint of this chapter)");
    try {
      *into = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception&) {
      require_usage(false, "--load " + dir + ": " + file + " is not JSON");
    }
  }
  const nlohmann::json want = config_json(g);
  for (const char* key : {"n_layer", "n_embd", "n_head", "n_positions", "vocab_size"})
    require_usage(config.value(key, nlohmann::json()) == want[key],
                  "--load " + dir + ": the checkpoint's " + key + " is " +
                      config.value(key, nlohmann::json()).dump() + ", this model's " +
                      want[key].dump() + " (give the same --layers --channels --heads --context)");
  const auto tensors = read_safetensors((d / "model.safetensors").string());
  std::map<std::string, Tensor> state;
  if (adam) state = read_safetensors((d / "optimizer.safetensors").string());
  const std::vector<nn::Parameter*> params = model.store().parameters();
  const std::int64_t P = model.store().size();
  Tensor m(shardlab::Shape{P}, shardlab::DType::f32), v(shardlab::Shape{P}, shardlab::DType::f32);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Piece& p = model.pieces()[i];
    auto take = [&](const std::map<std::string, Tensor>& from, const std::string& name) {
      const auto it = from.find(name);
      require_usage(it != from.end() && it->second.size() == p.whole.numel(),
                    "--load " + dir + ": " + (it == from.end() ? "no " : "a wrong-sized ") + name);
      return piece_of(p, it->second, g.heads);
    };
    params[i]->value.copy_from(take(tensors, p.name).reshape(params[i]->value.shape()));
    if (adam) {
      m.slice(params[i]->offset, p.size()).copy_from(take(state, "exp_avg." + p.name).flat());
      v.slice(params[i]->offset, p.size()).copy_from(take(state, "exp_avg_sq." + p.name).flat());
    }
  }
  if (adam) adam->restore(m, v, trainer.value("adam_steps", 0));
  (void)mesh;
  return trainer.value("step", 0);
}

}  // namespace ch09
