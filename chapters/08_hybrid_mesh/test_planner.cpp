// Chapter 08's planner against the numbers its papers print, and against the formulas
// evaluated by hand here (independently of planner.cpp):
//   - Narayanan et al. 2021 Table 1: every row's parameter column (to its 0.1B), eq. 2 exact
//     for one row; eq. 3 for one row; eq. 4's ≈34 days (GPT-3 175B, 1024 A100s, 140 TFLOP/s,
//     300B tokens) and ≈84 days (1T, 3072 GPUs, 163 TFLOP/s, 450B tokens);
//   - Korthikanti et al. 2022 Figure 1's activation memory per GPU (GiB), as the Calculon
//     project's validation transcribes it (calculon/llm/validation.py, "seqsel_fig1"): the 1T
//     model at tp 8, pp 64, b 1 holds 131.25 GiB without and 26.5625 GiB with sequence
//     parallelism and selective recomputation; the 22B at tp 8, pp 1, b 4, 59.25 and 9.5625;
//   - Table 2's coefficients, the memory categories, ZeRO's stages and the traffic of each axis
//     for a small layout by hand; the search; the node crossings against an enumeration of
//     every group; bad input;
//   - NCCL's rings over a node's NICs: a tp 4 ring on nodes of 2 and GPT-3's tp 16 over two
//     DGX A100s by hand (6.523 s, one ring's 52.18 s), and the share of a GPU's bytes that
//     leaves its node against an enumeration of every group's ring edges and all-to-all peers
//     (the worst node's, exactly where the groups tile the nodes).
//
// Wrong versions this test was checked against (each planted alone in planner.cpp; the
// first message it failed with, got == want):
//   eq. 2 without the 13/(12h) term
//     -> "76.1b: eq. 2 gives 76.0427B, Table 1 prints 76.1B", and "eq. 2 by hand for 1.7b:
//        1651507200 == 1652226048"
//   eq. 4 with 6 T P / (n X) when recomputing
//     -> "GPT-3 175B on 1024 A100s: 25.3755 days, the paper says about 34"
//   eq. 3 with 72 instead of 96
//     -> "eq. 3 for the 1.7b row" (1.16001e+16 == 1.54668e+16)
//   the activations not divided by t (s b h (34 + 5as/h) with tp)
//     -> "none, sp no, t 2" (9472 == 5376)
//   1F1B's first stage holding all m microbatches instead of min(p, m)
//     -> "1T, tp 8, no sp, no recompute" (1050 == 131.25 GiB)
//   the word embedding not split over tp
//     -> "stage parameters by hand" (1560 == 1304)
//   the norms and the two biases every tp rank holds whole counted as split over t
//     -> "stage parameters by hand" (1256 == 1304)
//   memory_per_gpu passing dp = 1 to ZeRO (no sharding)
//     -> "ZeRO 1: optimizer / dp" (15648 == 7824)
//   the search dropping the layouts that do not fit
//     -> "every valid layout is found: 13 == 35", "the search keeps the layouts that do not fit"
//   the search sorted slowest first
//     -> "the search is fastest first: entry 1" (102.396 <= 99.3187)
//   the search keeping tp within a node (tp <= GPUs per node)
//     -> "every valid layout is found: 23 == 35", "tp crossing nodes are listed, and marked"
//   crosses_nodes for tp as tp > GPUs per node (instead of GPUs per node % tp != 0)
//     -> "tp 2 x dp 1 x pp 2 on nodes of 3: tp crosses"
//   tp always on NVLink
//     -> across.axes[Axis::tp].seconds == inside's x 300/25 (2.02937 == 24.3525), then
//     "across.total_s()
//        > inside.total_s()"
//   the ring sending (n-1)/n instead of 2(n-1)/n
//     -> "tp bytes by hand" (4096 == 8192)
//   pp sending both ways from the end stages (pp = 2)
//     -> "pp bytes, pp 2" (2048 == 1024)
//   full recomputation with 4 tp allreduces instead of 6
//     -> "tp bytes with full recomputation" (8192 == 12288)
//   the bubble p/m instead of (p - 1)/m
//     -> "bubble (p-1)/m" (0.5 == 0.25)
//   selective recomputation keeping the 5as/h term
//     -> "selective, sp no, t 2" (5376 == 2816)
//   check_layout not checking that pp divides the layers
//     -> "pp 5 on 96 layers (no exception thrown)"
//   sequence parallelism's tp counted as plain tp's (no backward re-gather)
//     -> "tp bytes with sequence parallelism" (8192 == 10240)
//   the 22b preset planned with b = 1 (four microbatches instead of Table 3's one of 4)
//     -> "22b plans b = 1, m = 4"
//   a MoE layer's extra experts left out of eq. 2 (E MLPs counted as one)
//     -> "350m-moe128: 0.355918B, the paper prints 13B"
//   the activations not divided by cp
//     -> "cp 4 keeps a quarter: recompute none, sp false" (10752 == 2688)
//   the ring's backward without the gradients' last pass home (4 (c-1) blocks)
//     -> "cp bytes by hand" (4608 == 5120)
//   ep's all-to-all counting every choice, not the (e-1)/e that leave
//     -> "ep bytes by hand" (8192 == 4096)
//   the experts' gradients summed over the replicas d e c (as the dense ones)
//     -> the dp bytes by hand with ep 2 (15888 == 13680)
//   a cp group's crossing taken as a tp group's (g % c)
//     -> "tp 2 cp 2 ep 1 dp 1 pp 1 on nodes of 2: cp"
//   every byte of a group that crosses nodes on the network (one ring's per-GPU model)
//     -> "tp 8 on nodes of 4" seconds (24.3525 == 6.08812), "GPT-3's tp 16 over two DGX
//        A100s" (52.1839 == 6.52298)
//   the share across and the share on NVLink added, not sent at the same time
//     -> seconds (7.61015 == 6.08812), "GPT-3's tp 16 over two DGX A100s" (10.3281 == 6.52298)
//   a ring's share 1/g, its stride forgotten
//     -> "dp of tp 2 cp 1 ep 2 dp 2 pp 1 on nodes of 4: under the worst node" (1 >= 2)
//   the replicas' stride taken as e c t (the product of the faster axes) instead of t
//     -> "dp of tp 1 cp 1 ep 2 dp 2 pp 1 on nodes of 2: tiles the nodes" (2 == 1)
//   st/g for groups that do not tile the nodes (tp 3 on nodes of 2: no bound)
//     -> "dp of tp 1 cp 3 ep 1 dp 1 pp 2 on nodes of 2: under the worst node" (1 >= 2)
//   ep's all-to-all given a ring's share (or its peers off the node over s, not s - 1)
//     -> "ep of tp 1 cp 1 ep 4 dp 1 pp 1 on nodes of 2: under the worst node" (1 >= 1.33333)
//   one ring's time on the node's NICs together, not on one card
//     -> one_ring_s (6.08812 == 24.3525), (6.52298 == 52.1839)
#include <doctest/doctest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "machine.hpp"
#include "plan_report.hpp"
#include "planner.hpp"
#include "shardlab/check.hpp"
#include "shardlab/comm_threads.hpp"
#include "shardlab/launch.hpp"

using namespace ch08;
using shardlab::UsageError;

namespace {

const ModelSpec& preset(const char* name) {
  const ModelSpec* m = find_model(name);
  REQUIRE_MESSAGE(m != nullptr, "no preset " << name);
  return *m;
}

const ClusterSpec& a100() { return *find_cluster("a100-80gb"); }

// The small model of the by-hand cases: l 4, h 8, a 4, s 16, V 64.
ModelSpec tiny() {
  ModelSpec m;
  m.name = "tiny";
  m.layers = 4;
  m.hidden = 8;
  m.heads = 4;
  m.seq = 16;
  m.vocab = 64;
  return m;
}

constexpr double GiB = 1024.0 * 1024.0 * 1024.0;

// Every rank of every group along an axis, as the mesh lays them out, from the rank formula.
bool any_group_crosses(int dp, int tp, int pp, int axis, int g) {
  for (int a = 0; a < pp; ++a)
    for (int d = 0; d < dp; ++d)
      for (int t = 0; t < tp; ++t) {
        const int rank = (a * dp + d) * tp + t;
        // the group's first rank: the coordinate along the axis set to 0
        const int first = axis == 0 ? d * tp + t : axis == 1 ? a * dp * tp + t : (a * dp + d) * tp;
        if (rank / g != first / g) return true;
      }
  return false;
}

}  // namespace

TEST_SUITE("ch08 planner") {
  TEST_CASE("eq. 2 reproduces the parameter column of Narayanan et al. 2021 Table 1, every row") {
    struct Row {
      const char* name;
      int heads, hidden, layers;
      double billions;  // as printed
    };
    const Row table_1[] = {{"1.7b", 24, 2304, 24, 1.7},        {"3.6b", 32, 3072, 30, 3.6},
                           {"7.5b", 32, 4096, 36, 7.5},        {"18.4b", 48, 6144, 40, 18.4},
                           {"39.1b", 64, 8192, 48, 39.1},      {"76.1b", 80, 10240, 60, 76.1},
                           {"145.6b", 96, 12288, 80, 145.6},   {"310.1b", 128, 16384, 96, 310.1},
                           {"529.6b", 128, 20480, 105, 529.6}, {"1t", 160, 25600, 128, 1008.0}};
    for (const Row& row : table_1) {
      const ModelSpec& m = preset(row.name);
      CHECK_MESSAGE((m.heads == row.heads && m.hidden == row.hidden && m.layers == row.layers &&
                     m.seq == 2048 && m.vocab == 51200),
                    std::string(row.name) << ": the preset's shape differs from Table 1's");
      const double billions = parameters(m) / 1e9;
      CHECK_MESSAGE(std::fabs(billions - row.billions) < 0.05,
                    std::string(row.name) << ": eq. 2 gives " << billions << "B, Table 1 prints "
                                          << row.billions << "B");
    }
    // Exactly, for one row: 12 l h^2 + 13 l h + (V + s) h with l 24, h 2304.
    const double by_hand = 12.0 * 24 * 2304 * 2304 + 13.0 * 24 * 2304 + (51200.0 + 2048) * 2304;
    CHECK(by_hand == 1652226048.0);
    CHECK_MESSAGE(parameters(preset("1.7b")) == doctest::Approx(by_hand).epsilon(1e-13),
                  "eq. 2 by hand for 1.7b: " << std::llround(parameters(preset("1.7b")))
                                             << " == " << std::llround(by_hand));
    CHECK(parameters(preset("gpt3-175b")) / 1e9 == doctest::Approx(174.6).epsilon(3e-4));
  }

  TEST_CASE("eq. 3 for one row of Table 1, by hand; step_flops without recomputation") {
    // 1.7b, B = 512: 96 B s l h^2 + 16 B s^2 l h + 6 B s h V = 15466830067924992.
    const ModelSpec& m = preset("1.7b");
    CHECK_MESSAGE(
        flops_per_iteration(m, 512) == doctest::Approx(15466830067924992.0).epsilon(1e-13),
        "eq. 3 for the 1.7b row");
    CHECK(step_flops(m, 512, Recompute::full) == flops_per_iteration(m, 512));
    // 72 B s l h^2 + 12 B s^2 l h + 6 B s h V; selective adds 4 B s^2 h l.
    CHECK(step_flops(m, 512, Recompute::none) ==
          doctest::Approx(11785665138130944.0).epsilon(1e-13));
    CHECK(step_flops(m, 512, Recompute::selective) ==
          doctest::Approx(12260654161330176.0).epsilon(1e-13));
  }

  TEST_CASE("eq. 4 reproduces the paper's 34 days for GPT-3 175B and 84 for the 1T model") {
    const double gpt3 = training_days(parameters(preset("gpt3-175b")), 300e9, 1024, 140e12, true);
    CHECK_MESSAGE(std::fabs(gpt3 - 34) < 0.5,
                  "GPT-3 175B on 1024 A100s: " << gpt3 << " days, the paper says about 34");
    const double one_t = training_days(parameters(preset("1t")), 450e9, 3072, 163e12, true);
    CHECK_MESSAGE(std::fabs(one_t - 84) < 0.5,
                  "1T on 3072 A100s: " << one_t << " days, the paper says about 84");
    // Without recomputation 6 T P / (n X): 3/4 of it. In seconds, 86400 a day.
    CHECK(training_days(1e9, 1e9, 1, 1e12, false) == doctest::Approx(6e6 / 86400));
    CHECK(training_seconds(1e9, 1e9, 1, 1e12, true) == doctest::Approx(8e6));
  }

  TEST_CASE("Korthikanti et al. Table 2's coefficients, per layer and microbatch, by hand") {
    // tiny: s b h = 16 x 1 x 8 = 128, 5 a s / h = 5 x 4 x 16 / 8 = 40, t = 2.
    const ModelSpec m = tiny();
    struct Case {
      Recompute r;
      bool sp;
      int tp;
      double bytes;
    };
    const Case cases[] = {
        {Recompute::none, false, 1, 128 * (34 + 40)},       // no parallelism
        {Recompute::none, false, 2, 128 * (10 + 12 + 20)},  // 10 + 24/t + 5as/(ht)
        {Recompute::none, true, 2, 128 * (17 + 20)},        // 34/t + 5as/(ht)
        {Recompute::selective, false, 2, 128 * (10 + 12)},  // 10 + 24/t
        {Recompute::selective, true, 2, 128 * 17},          // 34/t
        {Recompute::full, false, 2, 128 * 2},               // 2 s b h
        {Recompute::full, true, 2, 128},                    // 2 s b h / t
        {Recompute::selective, false, 1, 128 * 34},         // t = 1: 34
    };
    for (const Case& c : cases)
      CHECK_MESSAGE(activation_bytes_per_layer(m, 1, c.tp, c.sp, c.r) == c.bytes,
                    recompute_name(c.r)
                        << ", sp " << std::string(c.sp ? "yes" : "no") << ", t " << c.tp);
    CHECK(activation_bytes_per_layer(m, 3, 2, false, Recompute::none) == 3 * 128 * 42);
  }

  TEST_CASE("Korthikanti et al. Figure 1: the first stage's activations for 1T and 22B") {
    // 1T (Table 3): tp 8, pp 64, b 1, B = 512 on 512 GPUs: dp 1, m = 512 >= p.
    Layout L{
        .mesh = {.pp = 64, .dp = 1, .tp = 8}, .microbatches = 512, .recompute = Recompute::none};
    CHECK_MESSAGE(memory_per_gpu(preset("1t"), L).activations / GiB == doctest::Approx(131.25),
                  "1T, tp 8, no sp, no recompute");
    L.sequence_parallel = true;
    L.recompute = Recompute::selective;
    CHECK_MESSAGE(memory_per_gpu(preset("1t"), L).activations / GiB == doctest::Approx(26.5625),
                  "1T, tp 8, sp + selective");
    // 22B: tp 8, pp 1, b 4, B = 4: one microbatch through its 48 layers.
    Layout K{.mesh = {.pp = 1, .dp = 1, .tp = 8},
             .microbatches = 1,
             .microbatch_size = 4,
             .recompute = Recompute::none};
    CHECK_MESSAGE(memory_per_gpu(preset("22b"), K).activations / GiB == doctest::Approx(59.25),
                  "22B, tp 8, b 4, no sp, no recompute");
    K.sequence_parallel = true;
    K.recompute = Recompute::selective;
    CHECK_MESSAGE(memory_per_gpu(preset("22b"), K).activations / GiB == doctest::Approx(9.5625),
                  "22B, tp 8, b 4, sp + selective");
  }

  TEST_CASE("memory by category for one layout by hand, and what each ZeRO stage shrinks") {
    // tiny on dp 2 x tp 2 x pp 2, m 4, b 1, no recomputation. The first stage: 2 layers of
    // 12 h^2 + 13 h = 872, of which the norms' 4 h and two biases' 2 h (48) are whole on each
    // tp rank and the other 824 over t = 2: 2 x 460 = 920; embeddings V h / t = 256 and
    // s h = 128: 1304.
    const ModelSpec m = tiny();
    CHECK_MESSAGE(stage_parameters(m, 2, 2) == 1304, "stage parameters by hand");
    CHECK(stage_parameters(m, 1, 1) == doctest::Approx(parameters(m) + 2 * 8));  // + ln_f
    Layout L{.mesh = {.pp = 2, .dp = 2, .tp = 2}, .microbatches = 4, .recompute = Recompute::none};
    MemoryEstimate e = memory_per_gpu(m, L);
    CHECK(e.params == 2 * 1304);
    CHECK(e.grads == 2 * 1304);
    CHECK(e.optimizer == 12 * 1304);
    // 128 (10 + 12 + 20) = 5376 a layer, x 2 layers x min(p = 2, m = 4) microbatches.
    CHECK(e.activations == 5376 * 2 * 2);
    CHECK(e.total() == 2608 + 2608 + 15648 + 21504);
    L.microbatches = 8;
    CHECK_MESSAGE(memory_per_gpu(m, L).activations == 21504, "activations, m = 8");
    L.microbatches = 1;
    CHECK_MESSAGE(memory_per_gpu(m, L).activations == 10752, "activations, m = 1");
    L.microbatches = 4;
    L.zero = 1;
    e = memory_per_gpu(m, L);
    CHECK_MESSAGE(e.optimizer == 7824, "ZeRO 1: optimizer / dp");
    CHECK((e.params == 2608 && e.grads == 2608 && e.activations == 21504));
    L.zero = 2;
    e = memory_per_gpu(m, L);
    CHECK_MESSAGE((e.grads == 1304 && e.optimizer == 7824 && e.params == 2608), "ZeRO 2");
    L.zero = 3;
    e = memory_per_gpu(m, L);
    CHECK_MESSAGE((e.params == 1304 && e.grads == 1304 && e.optimizer == 7824), "ZeRO 3");
    CHECK(e.activations == 21504);  // ZeRO never touches activations
  }

  TEST_CASE("each axis's bytes, time, and the bubble for one layout by hand") {
    // b s h = 128 values = 256 bytes. tp: 2 layers x 4 microbatches x 4 allreduces x
    // 2 (t-1)/t = 1 x 256 = 8192. dp: 2 (d-1)/d x 1304 x 2 bytes = 2608. pp (2 stages):
    // one direction a microbatch, 4 x 256 = 1024.
    const ModelSpec m = tiny();
    ClusterSpec c = a100();
    c.achieved_tflops = 1e-9;  // 1000 FLOP/s
    c.gpus_per_node = 8;
    Layout L{.mesh = {.pp = 2, .dp = 2, .tp = 2}, .microbatches = 4, .recompute = Recompute::none};
    StepEstimate st = step_time(m, c, L);
    CHECK_MESSAGE(st.axes[Axis::tp].bytes == 8192, "tp bytes by hand");
    CHECK(st.axes[Axis::dp].bytes == 2608);
    CHECK_MESSAGE(st.axes[Axis::pp].bytes == 1024, "pp bytes, pp 2");
    CHECK((!st.axes[Axis::tp].crosses_nodes && !st.axes[Axis::dp].crosses_nodes &&
           !st.axes[Axis::pp].crosses_nodes));
    CHECK(st.axes[Axis::tp].seconds == doctest::Approx(8192 / 300e9));
    CHECK(st.flops == step_flops(m, 8, Recompute::none));
    CHECK(st.compute_s == doctest::Approx(st.flops / (8 * 1000.0)));
    CHECK_MESSAGE(st.bubble_fraction == 0.25, "bubble (p-1)/m");
    CHECK(st.bubble_s == doctest::Approx(0.25 * st.compute_s));
    CHECK(st.total_s() == doctest::Approx(st.compute_s * 1.25 + st.axes[Axis::tp].seconds +
                                          st.axes[Axis::dp].seconds + st.axes[Axis::pp].seconds));
    L.recompute = Recompute::full;
    CHECK_MESSAGE(step_time(m, c, L).axes[Axis::tp].bytes == 12288,
                  "tp bytes with full recomputation");
    L.recompute = Recompute::none;
    L.zero = 3;
    CHECK(step_time(m, c, L).axes[Axis::dp].bytes == 3912);  // 3 (d-1)/d x 1304 x 2
    L.zero = 0;
    L.sequence_parallel = true;
    st = step_time(m, c, L);
    // tp: the forward's all-gathers and reduce-scatters move what its allreduces did, the
    // backward gathers the two column-parallel inputs again: 5 allreduces' worth, 10240.
    CHECK_MESSAGE(st.axes[Axis::tp].bytes == 10240, "tp bytes with sequence parallelism");
    CHECK_MESSAGE(st.axes[Axis::pp].bytes == 512, "pp bytes with sequence parallelism: / t");
    // An inner stage of 4 (1 layer each, on 16 GPUs) sends both ways: 2 x 4 x 256.
    L = {.mesh = {.pp = 4, .dp = 2, .tp = 2}, .microbatches = 4, .recompute = Recompute::none};
    st = step_time(m, c, L);
    CHECK(st.axes[Axis::pp].bytes == 2048);
    CHECK(st.axes[Axis::pp].crosses_nodes);  // 16 GPUs on nodes of 8
    CHECK(ring_allreduce_bytes(100, 1) == 0);
    CHECK(ring_allreduce_bytes(100, 4) == 150);
  }

  TEST_CASE("node crossings equal an enumeration of every group of every axis") {
    for (int g : {1, 2, 3, 4, 6, 8, 16})
      for (int dp = 1; dp <= 8; ++dp)
        for (int tp = 1; tp <= 8; ++tp)
          for (int pp = 1; pp <= 8; ++pp) {
            if (dp * tp * pp > 96) continue;
            const NodeCrossings c = crosses_nodes({.mesh = {.pp = pp, .dp = dp, .tp = tp}}, g);
            const std::string mesh = "tp " + std::to_string(tp) + " x dp " + std::to_string(dp) +
                                     " x pp " + std::to_string(pp) + " on nodes of " +
                                     std::to_string(g);
            CHECK_MESSAGE(c[Axis::tp] == any_group_crosses(dp, tp, pp, 2, g),
                          mesh << ": tp crosses");
            CHECK_MESSAGE(c[Axis::dp] == any_group_crosses(dp, tp, pp, 1, g),
                          mesh << ": dp crosses");
            CHECK_MESSAGE(c[Axis::pp] == any_group_crosses(dp, tp, pp, 0, g),
                          mesh << ": pp crosses");
          }
  }

  TEST_CASE("a tp group that crosses nodes takes the network and is slower than inside one") {
    const ModelSpec& m = preset("gpt3-175b");
    ClusterSpec c = a100();
    const Layout L{.mesh = {.pp = 16, .dp = 8, .tp = 8}, .microbatches = 192};
    const StepEstimate inside = step_time(m, c, L);
    c.gpus_per_node = c.nics_per_node = 4;
    const StepEstimate across = step_time(m, c, L);
    CHECK(!inside.axes[Axis::tp].crosses_nodes);
    CHECK_MESSAGE(across.axes[Axis::tp].crosses_nodes, "tp 8 on nodes of 4 takes the network");
    const double bytes = inside.axes[Axis::tp].bytes;
    CHECK(across.axes[Axis::tp].bytes == bytes);
    CHECK(inside.axes[Axis::tp].seconds == doctest::Approx(bytes / 300e9));
    CHECK(inside.axes[Axis::tp].one_ring_s == inside.axes[Axis::tp].seconds);
    // A ring of 8 over 2 nodes: 2 of its 8 edges between them, a quarter of a GPU's bytes on
    // its 25 GB/s; 3/4 on NVLink at 300 take a third of that time.
    CHECK_MESSAGE(across.axes[Axis::tp].cross_share == 0.25, "tp 8 on nodes of 4: share");
    CHECK(across.axes[Axis::tp].seconds == doctest::Approx(bytes / 4 / 25e9));
    CHECK(across.axes[Axis::tp].one_ring_s == doctest::Approx(bytes / 25e9));
    CHECK(across.total_s() > inside.total_s());
  }

  TEST_CASE("NCCL's rings over a node's NICs, by hand: tp 4 on nodes of 2, GPT-3's tp 16") {
    // tp: 4 layers x 4 allreduces of b s h = 256 bytes, 2 (t-1)/t = 1.5 of each: 6144 bytes
    // a GPU. A ring 0 1 2 3 on nodes {0 1} {2 3}: edges 1-2 and 3-0 cross, 2 of 4, so half
    // a GPU's bytes go on its 25 GB/s share of the node's NICs (1.2288e-7 s) and half on
    // NVLink at the same time (1.024e-8 s). One ring: the GPU at its edge between the nodes
    // sends all 6144 on one NIC of 25 GB/s (2.4576e-7 s), or 50 GB/s if the node's 50 GB/s
    // are one card.
    const ModelSpec m = tiny();
    ClusterSpec c = a100();
    c.gpus_per_node = c.nics_per_node = 2;
    const Layout L{.mesh = {.tp = 4}, .microbatches = 1, .recompute = Recompute::none};
    AxisCost tp = step_time(m, c, L).axes[Axis::tp];
    CHECK(tp.bytes == 6144);
    CHECK(tp.crosses_nodes);
    CHECK_MESSAGE(tp.cross_share == 0.5, "2 of the ring's 4 edges cross");
    CHECK_MESSAGE(tp.seconds == doctest::Approx(1.2288e-7),
                  "half the bytes across, on a GPU's share of the NICs");
    CHECK(tp.busbw_GBps == doctest::Approx(50));
    CHECK_MESSAGE(tp.one_ring_s == doctest::Approx(2.4576e-7), "one ring: all of it on one NIC");
    c.nics_per_node = 1;
    tp = step_time(m, c, L).axes[Axis::tp];
    CHECK_MESSAGE(tp.one_ring_s == doctest::Approx(1.2288e-7), "one ring on a node's one card");
    CHECK(tp.seconds == doctest::Approx(1.2288e-7));
    // NVLink slower than the network (10 GB/s): the half on it, 3072 / 10e9, sets the time.
    c.nvlink_GBps = 10;
    CHECK_MESSAGE(step_time(m, c, L).axes[Axis::tp].seconds == doctest::Approx(3.072e-7),
                  "the two halves go at the same time: the slower one's time");

    // GPT-3 on 1024 A100s as pp 8 x dp 8 x tp 16: 192 microbatches x 12 layers x 6
    // allreduces of 2 x 2048 x 12288 bytes, 2 x 15/16 of each = 1 304 596 316 160 bytes a GPU;
    // 1/8 of them between the two nodes at 25 GB/s: 6.5229815808 s (7/8 on NVLink: 3.8 s).
    // One ring: 52.1838526464 s.
    const StepEstimate st = step_time(preset("gpt3-175b"), a100(),
                                      {.mesh = {.pp = 8, .dp = 8, .tp = 16}, .microbatches = 192});
    const double bytes = 192.0 * 12 * 6 * 2 * 15 / 16 * 2 * 2048 * 12288;
    CHECK(st.axes[Axis::tp].bytes == doctest::Approx(bytes));
    CHECK(st.axes[Axis::tp].cross_share == 0.125);
    CHECK_MESSAGE(st.axes[Axis::tp].seconds == doctest::Approx(6.5229815808),
                  "GPT-3's tp 16 over two DGX A100s");
    CHECK(st.axes[Axis::tp].one_ring_s == doctest::Approx(52.1838526464));
    CHECK(st.axes[Axis::tp].busbw_GBps == doctest::Approx(200));  // the node's 8 x 25 GB/s
    // pp and dp: a node to each member (strides 128 and 16 on nodes of 8), all across.
    CHECK(st.axes[Axis::pp].cross_share == 1);
    CHECK(st.axes[Axis::dp].cross_share == 1);
    CHECK(st.axes[Axis::dp].one_ring_s == st.axes[Axis::dp].seconds);
  }

  TEST_CASE("the share that leaves a node is the worst node's, by an enumeration of every group") {
    // For every group of every axis (rank = (((pp_i d + dp_i) e + ep_i) c + cp_i) t + tp_i),
    // each GPU's traffic that leaves its node, in units of its bytes: a ring's member sends
    // to the next (the last to the first), all of it across if they are on two nodes; an
    // all-to-all's member sends (s - 1)ths to each other member. A node's NICs carry its
    // GPUs' sum, so the worst node over g is what cross_node_share must give: exactly where
    // the groups tile the nodes (each group on 2 or more nodes, the same number of members
    // on each), never less anywhere.
    for (int g : {1, 2, 3, 4, 6, 8})
      for (int tp : {1, 2, 3, 4})
        for (int cp : {1, 2, 3, 4})
          for (int ep : {1, 2, 4})
            for (int dp : {1, 2})
              for (int pp : {1, 2}) {
                const Layout L{.mesh = {.pp = pp, .dp = dp, .ep = ep, .cp = cp, .tp = tp}};
                const int size[5] = {pp, dp, ep, cp, tp};
                const int n = int(L.gpus());
                for (int axis : {1, 2, 3, 4}) {  // dp (the replicas), ep, cp, tp
                  // The groups: ranks with equal coordinates off the axis, in its order.
                  std::vector<std::vector<int>> groups;
                  std::vector<int> key_of;
                  for (int rank = 0; rank < n; ++rank) {
                    int coord[5], rest = rank;
                    for (int a = 4; a >= 0; --a) coord[a] = rest % size[a], rest /= size[a];
                    int key = 0;
                    for (int a = 0; a < 5; ++a) {
                      const bool along = a == axis || (axis == 1 && (a == 2 || a == 3));
                      key = key * size[a] + (along ? 0 : coord[a]);
                    }
                    const auto at = std::find(key_of.begin(), key_of.end(), key);
                    if (at == key_of.end()) {
                      key_of.push_back(key);
                      groups.push_back({rank});
                    } else {
                      groups[std::size_t(at - key_of.begin())].push_back(rank);
                    }
                  }
                  std::vector<double> node(std::size_t((n + g - 1) / g), 0.0);
                  bool tiles = groups.front().size() > 1;
                  std::set<int> members_on_a_node;
                  for (const std::vector<int>& grp : groups) {
                    const int s = int(grp.size());
                    std::map<int, int> per_node;
                    for (int r : grp) ++per_node[r / g];
                    tiles &= per_node.size() > 1;
                    for (const auto& [_, count] : per_node) members_on_a_node.insert(count);
                    for (int i = 0; i < s && s > 1; ++i) {
                      const int r = grp[std::size_t(i)];
                      if (axis == 2) {
                        int off = 0;
                        for (int o : grp) off += o / g != r / g;
                        node[std::size_t(r / g)] += double(off) / (s - 1);
                      } else {
                        node[std::size_t(r / g)] += grp[std::size_t((i + 1) % s)] / g != r / g;
                      }
                    }
                  }
                  tiles &= members_on_a_node.size() == 1;
                  const double worst = *std::max_element(node.begin(), node.end());
                  const Axis a = kAxes[axis];
                  const double share = cross_node_share(L, a, g);
                  const std::string what = std::string(axis_name(a)) + " of tp " +
                                           std::to_string(tp) + " cp " + std::to_string(cp) +
                                           " ep " + std::to_string(ep) + " dp " +
                                           std::to_string(dp) + " pp " + std::to_string(pp) +
                                           " on nodes of " + std::to_string(g);
                  CHECK_MESSAGE((share > 0) == crosses_nodes(L, g)[a], what << ": crosses");
                  CHECK_MESSAGE(share * g >= worst - 1e-12, what << ": under the worst node");
                  if (tiles)
                    CHECK_MESSAGE(share * g == doctest::Approx(worst), what << ": tiles the nodes");
                }
                CHECK(cross_node_share(L, Axis::pp, g) == (crosses_nodes(L, g)[Axis::pp] ? 1 : 0));
              }
  }

  TEST_CASE("the search: every valid layout, fastest first, the misfits kept and marked") {
    const ModelSpec& m = preset("gpt3-175b");
    const SearchSpec spec{.gpus = 1024, .batch = 1536, .recompute = Recompute::selective};
    const std::vector<Candidate> found = search(m, a100(), spec);
    // Independently: every (dp, cp, tp, pp) with product 1024 that the rules allow (cp
    // cutting 2048 tokens into 2 cp chunks; a dense model has no ep).
    std::set<std::vector<int>> want, got;
    for (int tp = 1; tp <= 1024; ++tp)
      for (int cp = 1; cp <= 1024; ++cp)
        for (int pp = 1; pp <= 1024; ++pp) {
          if (1024 % (tp * cp * pp)) continue;
          const int dp = 1024 / (tp * cp * pp);
          if (96 % tp == 0 && 12288 % tp == 0 && 96 % pp == 0 && 1536 % dp == 0 &&
              (cp == 1 || 2048 % (2 * cp) == 0))
            want.insert({dp, cp, tp, pp, 1536 / dp});
        }
    for (const Candidate& k : found) {
      const Layout& L = k.layout;
      CHECK(L.mesh.ep == 1);
      got.insert({L.mesh.dp, L.mesh.cp, L.mesh.tp, L.mesh.pp, L.microbatches});
      CHECK(L.gpus() == 1024);
      CHECK(L.batch() == 1536);
      CHECK((m.heads % L.mesh.tp == 0 && m.hidden % L.mesh.tp == 0 && m.layers % L.mesh.pp == 0));
      CHECK((L.zero == 0 && L.recompute == Recompute::selective && L.microbatch_size == 1));
      CHECK(k.memory.total() == memory_per_gpu(m, L).total());
      CHECK(k.step.total_s() == step_time(m, a100(), L).total_s());
      CHECK(k.fits == (k.memory.total() <= 80e9));
    }
    CHECK_MESSAGE(got == want,
                  "every valid layout is found: " << got.size() << " == " << want.size());
    CHECK(got.size() == found.size());
    for (std::size_t i = 1; i < found.size(); ++i)
      CHECK_MESSAGE(found[i - 1].step.total_s() <= found[i].step.total_s(),
                    "the search is fastest first: entry " << i);
    const auto misfits = std::count_if(found.begin(), found.end(), [](auto& k) { return !k.fits; });
    CHECK_MESSAGE(misfits > 0, "the search keeps the layouts that do not fit");
    CHECK(misfits < std::ptrdiff_t(found.size()));
    CHECK_MESSAGE(
        std::any_of(found.begin(), found.end(),
                    [](auto& k) { return k.layout.mesh.tp > 8 && k.crossings[Axis::tp]; }),
        "tp crossing nodes are listed, and marked");
  }

  TEST_CASE("DeepSpeed-MoE's two models: 13B and 52B, and the parameters a token meets") {
    // Rajbhandari et al. 2022 give them as 13B and 52B: the base model (eq. 2) and
    // its 12 MoE layers' 127 more MLPs and routers, written out here.
    struct Row {
      const char* name;
      double h, printed;
    };
    for (const Row& r : {Row{"350m-moe128", 1024, 13}, Row{"1.3b-moe128", 2048, 52}}) {
      const ModelSpec& m = preset(r.name);
      CHECK((m.layers == 24 && m.heads == 16 && m.experts == 128 && m.top_k == 1 &&
             m.moe_every == 2 && m.moe_layers(0, 24) == 12));
      const double h = r.h, l = 24, V = 50304, s = 2048;
      const double dense = 12 * l * h * h + 13 * l * h + (V + s) * h;
      const double moe = 12 * (127 * (8 * h * h + 5 * h) + 128 * h);
      CHECK(parameters(m) == doctest::Approx(dense + moe).epsilon(1e-12));
      CHECK_MESSAGE(std::round(parameters(m) / 1e9) == r.printed,
                    std::string(r.name) << ": " << parameters(m) / 1e9 << "B, the paper prints "
                                        << r.printed << "B");
      // A token meets one expert of each MoE layer (top-1) and the routers: the dense
      // model's count and 128 h a MoE layer.
      CHECK(active_parameters(m) == doctest::Approx(dense + 12 * 128 * h).epsilon(1e-12));
      // Eq. 3 is the dense model's for top-1; top-2 adds 64 B s h^2 a MoE layer.
      ModelSpec two = m;
      two.top_k = 2;
      CHECK(flops_per_iteration(two, 512) - flops_per_iteration(m, 512) ==
            doctest::Approx(12 * 64 * 512 * s * h * h));
    }
    // The default plan: every expert on a GPU of its own (ep 128), as its Table 6 lays it out.
    PlanSettings s;
    s.model = "1.3b-moe128";
    const ResolvedPlan plan = resolve_plan(s);
    CHECK((plan.layout.mesh.ep == 128 && plan.layout.mesh.dp == 1 && plan.layout.batch() == 512));
  }

  TEST_CASE("cp and ep by hand: 1/c of the activations, the ring's bytes, the experts over ep") {
    // tiny: l 4, h 8, a 4, s 16. cp 2: a GPU's 8 tokens of each sequence.
    const ModelSpec m = tiny();
    for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full})
      for (bool sp : {false, true})
        CHECK_MESSAGE(activation_bytes_per_layer(m, 2, 2, sp, r, 4) ==
                          activation_bytes_per_layer(m, 2, 2, sp, r) / 4,
                      "cp 4 keeps a quarter: recompute " << recompute_name(r) << ", sp " << sp);
    ClusterSpec c = a100();
    c.gpus_per_node = 64;
    Layout L{.mesh = {.pp = 1, .dp = 1, .cp = 4, .tp = 2},
             .microbatches = 2,
             .recompute = Recompute::none};
    StepEstimate st = step_time(m, c, L);
    // A block of k or v: s/c b h/t = 4 x 1 x 4 values, 32 bytes; forward 2 (c-1) = 6 blocks,
    // backward 4 (c-1) + 2 = 14; x 4 layers x 2 microbatches = 32 x 20 x 8.
    CHECK_MESSAGE(st.axes[Axis::cp].bytes == 32 * 20 * 8, "cp bytes by hand");
    L.recompute = Recompute::selective;  // the forward again in the backward
    CHECK(step_time(m, c, L).axes[Axis::cp].bytes == 32 * 26 * 8);
    // tp's b s h values are a GPU's: s/c of them. 4 allreduces of 4 x 8 values (64 bytes),
    // 2 (t-1)/t = 1 each, 4 layers, 2 microbatches.
    CHECK(st.axes[Axis::tp].bytes == 4 * 64 * 4 * 2);
    // dp: the replicas are dp x cp = 4 GPUs (d 1 here): 2 (n-1)/n of the stage's weights.
    CHECK(st.axes[Axis::dp].size == 4);
    CHECK(st.axes[Axis::dp].bytes == doctest::Approx(2.0 * 2 * 3 / 4 * stage_parameters(m, 2, 1)));

    // A MoE tiny: 4 experts, top-2, in every other layer (layers 0 and 2).
    ModelSpec moe = m;
    moe.experts = 4;
    moe.top_k = 2;
    moe.moe_every = 2;
    CHECK(moe.moe_layers(0, 4) == 2);
    CHECK(moe.moe_layers(1, 2) == 1);  // layers 1 and 2: layer 2 has one
    CHECK(moe.moe_layers(1, 1) == 0);
    // Experts over ep: 2 MoE layers x 4/e experts x ((8 h^2 + 4 h)/t + h): fc2's bias whole.
    CHECK(expert_parameters(moe, 1, 1, 2) == 2 * 2 * (8 * 64 + 5 * 8));
    CHECK(expert_parameters(moe, 2, 2, 4) == 1 * 1 * ((8 * 64 + 4 * 8) / 2.0 + 8));
    // The dense weights lose the MoE layers' MLPs and gain their routers.
    CHECK(stage_parameters(moe, 1, 1) ==
          stage_parameters(m, 1, 1) - 2 * (8 * 64 + 5 * 8) + 2 * 8 * 4);
    CHECK(stage_parameters(moe, 2, 1) ==
          stage_parameters(m, 2, 1) - 2 * ((8 * 64 + 4 * 8) / 2.0 + 8) + 2 * 8 * 4);
    Layout E{.mesh = {.pp = 1, .dp = 2, .ep = 2, .tp = 1},
             .microbatches = 2,
             .recompute = Recompute::none};
    st = step_time(moe, c, E);
    // ep: 4 passes x k 2 x b s h (16 x 8 values, 256 bytes) x (e-1)/e, 2 MoE layers, 2
    // microbatches.
    CHECK_MESSAGE(st.axes[Axis::ep].bytes == 4 * 2 * 256 / 2 * 2 * 2, "ep bytes by hand");
    // dp: the dense weights over d e = 4 GPUs, the experts over d = 2.
    CHECK(st.axes[Axis::dp].bytes ==
          doctest::Approx(2.0 * (2 * 3.0 / 4 * stage_parameters(moe, 1, 1) +
                                 2 * 1.0 / 2 * expert_parameters(moe, 1, 1, 2))));
    // Memory: the experts' states over d (2), the dense weights' over d e (4), ZeRO 1.
    E.zero = 1;
    const MemoryEstimate mem = memory_per_gpu(moe, E);
    const double dense = stage_parameters(moe, 1, 1), experts = expert_parameters(moe, 1, 1, 2);
    CHECK(mem.params == doctest::Approx(2 * (dense + experts)));
    CHECK(mem.optimizer == doctest::Approx(12 * (dense / 4 + experts / 2)));
    CHECK(E.batch() == 2 * 2 * 2);  // B = d e m b
  }

  TEST_CASE("five axes' node crossings equal an enumeration of every group") {
    // rank = (((pp_i d + dp_i) e + ep_i) c + cp_i) t + tp_i, every group of every axis.
    auto enumerate = [](const Layout& L, int axis, int g) {  // axis: 0 pp 1 dp 2 ep 3 cp 4 tp
      const int size[5] = {L.mesh.pp, L.mesh.dp, L.mesh.ep, L.mesh.cp, L.mesh.tp};
      const int n = int(L.gpus());
      for (int rank = 0; rank < n; ++rank) {
        int coord[5], rest = rank;
        for (int a = 4; a >= 0; --a) coord[a] = rest % size[a], rest /= size[a];
        int first = 0;  // the group's first rank: the coordinate along `axis` at 0 (dp:
        for (int a = 0; a < 5; ++a) {  // the replicas, dp, ep and cp all at 0)
          const bool zeroed = a == axis || (axis == 1 && (a == 2 || a == 3));
          first = first * size[a] + (zeroed ? 0 : coord[a]);
        }
        if (rank / g != first / g) return true;
      }
      return false;
    };
    for (int g : {1, 2, 4, 6, 8})
      for (int tp : {1, 2, 4})
        for (int cp : {1, 2, 3})
          for (int ep : {1, 2})
            for (int dp : {1, 2})
              for (int pp : {1, 2}) {
                const Layout L{.mesh = {.pp = pp, .dp = dp, .ep = ep, .cp = cp, .tp = tp}};
                const NodeCrossings c = crosses_nodes(L, g);
                const std::string mesh = "tp " + std::to_string(tp) + " cp " + std::to_string(cp) +
                                         " ep " + std::to_string(ep) + " dp " + std::to_string(dp) +
                                         " pp " + std::to_string(pp) + " on nodes of " +
                                         std::to_string(g);
                CHECK_MESSAGE(c[Axis::tp] == enumerate(L, 4, g), mesh << ": tp");
                CHECK_MESSAGE(c[Axis::cp] == enumerate(L, 3, g), mesh << ": cp");
                CHECK_MESSAGE(c[Axis::ep] == enumerate(L, 2, g), mesh << ": ep");
                CHECK_MESSAGE(c[Axis::dp] == enumerate(L, 1, g), mesh << ": dp (the replicas)");
                CHECK_MESSAGE(c[Axis::pp] == enumerate(L, 0, g), mesh << ": pp");
              }
  }

  TEST_CASE("the search considers cp and, for a MoE model, ep") {
    const ModelSpec& m = preset("1.3b-moe128");
    const std::vector<Candidate> found = search(m, a100(), {.gpus = 128, .batch = 512});
    bool some_ep = false, some_cp = false;
    for (const Candidate& k : found) {
      const Layout& L = k.layout;
      CHECK(L.gpus() == 128);
      CHECK(L.batch() == 512);
      CHECK((m.experts % L.mesh.ep == 0 && 2048 % (2 * L.mesh.cp) == 0));
      some_ep |= L.mesh.ep > 1;
      some_cp |= L.mesh.cp > 1;
    }
    CHECK(some_ep);
    CHECK(some_cp);
    CHECK(std::any_of(found.begin(), found.end(),
                      [](const Candidate& k) { return k.layout.mesh.ep == 128; }));
  }

  TEST_CASE("the plan's defaults: the seeds' layouts and the paper's runs") {
    const ResolvedPlan gpt3 = resolve_plan({});
    CHECK(gpt3.model.name == "gpt3-175b");
    CHECK(gpt3.gpus == 1024);
    CHECK((gpt3.layout.mesh.dp == 8 && gpt3.layout.mesh.tp == 8 && gpt3.layout.mesh.pp == 16));
    CHECK((gpt3.layout.microbatches == 192 && gpt3.layout.batch() == 1536));
    CHECK((gpt3.cluster.achieved_tflops == 140 && gpt3.tokens == 300e9));
    PlanSettings s;
    s.model = "1t";
    const ResolvedPlan one_t = resolve_plan(s);
    CHECK(one_t.gpus == 3072);
    CHECK((one_t.layout.mesh.dp == 6 && one_t.layout.mesh.tp == 8 && one_t.layout.mesh.pp == 64));
    CHECK((one_t.cluster.achieved_tflops == 163 && one_t.tokens == 450e9));
    s.model = "22b";  // Table 3's one microbatch of b = 4, not four of 1
    const ResolvedPlan k22 = resolve_plan(s);
    CHECK_MESSAGE(
        (k22.layout.microbatch_size == 4 && k22.layout.microbatches == 1 &&
         k22.layout.batch() == 4),
        "22b plans b = " << k22.layout.microbatch_size << ", m = " << k22.layout.microbatches);
    s.microbatch_size = 2;  // a flag still wins
    CHECK(resolve_plan(s).layout.microbatches == 2);
    s.microbatch_size = 0;
    s.model = "1t";
    s.cluster = "h100-80gb";  // the run's X was on A100s: the cluster's own
    CHECK(resolve_plan(s).cluster.achieved_tflops == 400);
    s = {};
    s.mesh.tp = 4;  // dp follows: 1024 / (4 x 16)
    CHECK(resolve_plan(s).layout.mesh.dp == 16);
    s = {};
    s.search = true;  // the search's fastest that fits
    const ResolvedPlan searched = resolve_plan(s);
    CHECK(!searched.candidates.empty());
    const auto first_fit = std::find_if(searched.candidates.begin(), searched.candidates.end(),
                                        [](auto& k) { return k.fits; });
    REQUIRE(first_fit != searched.candidates.end());
    CHECK(searched.layout.mesh.dp == first_fit->layout.mesh.dp);
    CHECK(searched.layout.mesh.tp == first_fit->layout.mesh.tp);
    CHECK(searched.layout.mesh.pp == first_fit->layout.mesh.pp);
  }

  TEST_CASE("the flags: quantities parse, absurd ones are refused") {
    PlanSettings s;
    CLI::App app;
    add_plan_options(app, s);
    app.parse(std::vector<std::string>{"2^10", "--gpus", "450B", "--tokens"});  // reversed argv
    CHECK(s.gpus == 1024);
    CHECK(s.tokens == 450e9);
    for (const char* bad : {"1e12", "0", "-8", "nan"}) {
      PlanSettings t;
      CLI::App other;
      add_plan_options(other, t);
      CHECK_THROWS_AS(other.parse(std::vector<std::string>{bad, "--gpus"}), CLI::ParseError);
    }
    // The layout is the planner's own too: a layout given is the one planned.
    PlanSettings l;
    CLI::App layout;
    add_plan_options(layout, l);
    layout.parse(
        std::vector<std::string>{"8", "--microbatches", "16", "--pp", "8", "--tp", "8", "--dp"});
    CHECK(l.mesh.dp == 8);
    CHECK(l.mesh.tp == 8);
    CHECK(l.mesh.pp == 16);
    CHECK(l.microbatches == 8);
    CHECK(resolve_plan(l).layout.mesh.tp == 8);
  }

  TEST_CASE("bad input is a UsageError of one line") {
    const auto refused = [](const PlanSettings& s, const std::string& what) {
      bool threw = false;
      try {
        validate_plan(s);
      } catch (const UsageError& e) {
        threw = true;
        CHECK_MESSAGE(std::string(e.what()).find('\n') == std::string::npos, what);
        CHECK_MESSAGE(!std::string(e.what()).empty(), what);
      }
      CHECK_MESSAGE(threw, what << " (no exception thrown)");
    };
    PlanSettings s;
    s.mesh.tp = 5;
    s.gpus = 1280;
    refused(s, "tp 5 on 96 heads");
    s = {};
    s.mesh.pp = 5;
    s.gpus = 640;
    refused(s, "pp 5 on 96 layers");
    s = {};
    s.mesh.dp = 4;
    s.gpus = 1024;
    refused(s, "dp 4 x tp 8 x pp 16 on 1024 GPUs");
    s = {};
    s.gpus = 1e12;
    refused(s, "1e12 GPUs");
    s.gpus = 1000;
    refused(s, "1000 GPUs: tp x pp does not divide them");
    s.gpus = 2.5;
    refused(s, "2.5 GPUs");
    s = {};
    s.mesh.dp = 1 << 20;
    refused(s, "2^20 x 8 x 16 GPUs");
    s = {};
    s.model = "gpt5";
    refused(s, "an unknown model");
    s = {};
    s.cluster = "tpu-v9";
    refused(s, "an unknown cluster");
    s = {};
    s.layers = -4;
    refused(s, "negative layers");
    s = {};
    s.hidden = 1000;  // 96 heads
    refused(s, "h not a multiple of a");
    s = {};
    s.model = "custom";
    s.layers = 32;
    refused(s, "custom without --hidden and --heads");
    s.hidden = 4096;
    s.heads = 32;
    refused(s, "custom without --gpus");
    s.gpus = 64;
    refused(s, "custom without --batch");
    s.batch = 512;
    CHECK_NOTHROW(validate_plan(s));
    s = {};
    s.batch = 1004;  // dp 8
    refused(s, "a batch of 1004 on dp 8");
    s.batch = 1536;
    s.microbatches = 100;
    refused(s, "--batch 1536 against 8 x 100 x 1");
    s = {};
    s.achieved_tflops = 400;
    refused(s, "X above the A100's peak");
    s = {};
    s.zero = 4;
    refused(s, "ZeRO 4");
    s = {};
    s.recompute = "some";
    refused(s, "recompute some");
    s = {};
    s.gpu_memory_gb = -1;
    refused(s, "negative memory");
    s = {};
    s.microbatch_size = -1;
    refused(s, "b = -1");
    s = {};
    s.search = true;
    s.gpus = 1009;  // prime: no dp divides the batch, no tp the heads, no pp the layers
    refused(s, "--search on 1009 GPUs");
    CHECK_THROWS_AS(search(preset("1t"), a100(), {.gpus = 1'000'000'000'000, .batch = 8}),
                    UsageError);
    CHECK_THROWS_AS(check_layout(preset("gpt3-175b"), {.mesh = {.pp = 0, .dp = 8, .tp = 8}}, 0),
                    UsageError);
    CHECK_THROWS_AS(parse_recompute("partial"), UsageError);
  }

  TEST_CASE("report_plan fills the JSON without communicating; a misfit is a result") {
    const auto report = [](const PlanSettings& s) {
      shardlab::Options options;
      options.quiet = true;
      nlohmann::json out;
      std::vector<std::uint64_t> calls(2);
      shardlab::run_threads(2, [&](shardlab::Communicator& comm) {
        shardlab::Context ctx(comm, options);
        report_plan(ctx, s);  // on every rank; rank 0 writes the JSON
        if (comm.rank() == 0) out = ctx.json();
        calls[std::size_t(comm.rank())] = comm.stats().total().calls;
      });
      CHECK_MESSAGE((calls[0] == 0 && calls[1] == 0), "report_plan communicated");
      return out;
    };
    PlanSettings s;
    s.search = true;
    s.mesh.tp = 8;
    s.mesh.pp = 16;
    const nlohmann::json j = report(s);
    const ResolvedPlan p = resolve_plan(s);
    CHECK(j["params"].get<double>() == parameters(p.model));
    CHECK(j["flops_per_iteration"].get<double>() == flops_per_iteration(p.model, 1536));
    CHECK(j["training_days"].get<double>() == doctest::Approx(33.834).epsilon(1e-4));
    const MemoryEstimate mem = memory_per_gpu(p.model, p.layout);
    CHECK(j["memory_per_gpu_bytes"]["total"].get<double>() == mem.total());
    CHECK(j["memory_per_gpu_bytes"]["activations"].get<double>() == mem.activations);
    CHECK(j["fits"].get<bool>());
    const StepEstimate st = step_time(p.model, p.cluster, p.layout);
    CHECK(j["communication_bytes"]["tp"].get<double>() == st.axes[Axis::tp].bytes);
    CHECK(j["communication_time_s"]["pp"].get<double>() == st.axes[Axis::pp].seconds);
    CHECK(j["cross_node_share"]["dp"].get<double>() == st.axes[Axis::dp].cross_share);
    CHECK(j["one_ring_time_s"]["dp"].get<double>() == st.axes[Axis::dp].one_ring_s);
    CHECK(j["bubble_fraction"].get<double>() == doctest::Approx(15.0 / 192));
    CHECK(j["step_time_s"].get<double>() == st.total_s());
    REQUIRE(j["search"].is_array());
    CHECK(j["search"].size() == p.candidates.size());
    for (const char* key :
         {"dp", "tp", "pp", "microbatches", "step_time_s", "memory_per_gpu_bytes", "fits"})
      CHECK_MESSAGE(j["search"][0].contains(key), std::string(key));
    REQUIRE(j["seed_layouts"].size() == 2);
    CHECK(j["seed_layouts"][0]["gpus"].get<int>() == 3072);
    CHECK(j["seed_layouts"][1]["gpus"].get<int>() == 1024);

    PlanSettings tight;
    tight.gpu_memory_gb = 10;
    const nlohmann::json misfit = report(tight);
    CHECK(!misfit["fits"].get<bool>());
    CHECK(misfit["memory_per_gpu_bytes"]["total"].get<double>() > 10e9);
  }

  TEST_CASE("overlap hides what each axis's rule allows, never more than the computation") {
    // tiny on dp 2 x tp 2 x pp 2, m 4: by hand from the step without overlap.
    const ModelSpec m = tiny();
    ClusterSpec c = a100();
    c.achieved_tflops = 1e-9;  // 1000 FLOP/s: the computation far longer than the traffic
    Layout L{.mesh = {.pp = 2, .dp = 2, .tp = 2}, .microbatches = 4, .recompute = Recompute::none};
    const StepEstimate plain = step_time(m, c, L);
    for (Axis axis : kAxes) CHECK(plain.axes[axis].hidden_s == 0);
    CHECK(plain.total_s() ==
          doctest::Approx(plain.compute_s + plain.bubble_s + plain.communication_s()));
    L.overlap = true;
    const StepEstimate over = step_time(m, c, L);
    CHECK(over.communication_s() == plain.communication_s());  // the same traffic
    CHECK_MESSAGE(over.axes[Axis::tp].hidden_s == doctest::Approx(plain.axes[Axis::tp].seconds / 2),
                  "tp: 2 parts, the first's sum hidden");
    CHECK_MESSAGE(
        over.axes[Axis::dp].hidden_s == doctest::Approx(plain.axes[Axis::dp].seconds * 3 / 4),
        "dp: all but the last of 4 buckets");
    CHECK_MESSAGE(
        over.axes[Axis::pp].hidden_s == doctest::Approx(plain.axes[Axis::pp].seconds * 3 / 4),
        "pp: all but the first of m = 4 messages");
    CHECK(over.total_s() ==
          doctest::Approx(plain.total_s() - over.axes[Axis::tp].hidden_s -
                          over.axes[Axis::dp].hidden_s - over.axes[Axis::pp].hidden_s));
    // A computation far shorter than the traffic: at most all of it hidden, together.
    c.achieved_tflops = 1e6;
    const StepEstimate fast = step_time(m, c, L);
    double hidden = 0;
    for (Axis axis : kAxes) hidden += fast.axes[axis].hidden_s;
    CHECK_MESSAGE(hidden <= fast.compute_s * (1 + 1e-12), "hidden beyond the computation");
    CHECK(hidden > 0);
    CHECK(fast.total_s() >= fast.compute_s + fast.bubble_s);
    // The rules one by one.
    L.buckets = 8;
    CHECK(hidden_seconds(Axis::dp, 8, 100, 100, L) == 7);
    CHECK(hidden_seconds(Axis::dp, 8, 100, 1, L) == 1);  // only under the last backward
    L.zero = 1;  // 4 reduce-scattered (3.5 under the backward), 4 gathered (3.5 under forward)
    CHECK(hidden_seconds(Axis::dp, 8, 100, 100, L) == 7);
    CHECK(hidden_seconds(Axis::dp, 8, 100, 4, L) == 3.5 + 2);  // a forward half a backward
    CHECK(hidden_seconds(Axis::dp, 8, 100, 2, L) == 2 + 1);
    L.sequence_parallel = true;  // the reduce-scatter after tp's sums: only the all-gather
    CHECK(hidden_seconds(Axis::dp, 8, 100, 100, L) == 3.5);
    L.sequence_parallel = false;
    L.zero = 0;
    CHECK(hidden_seconds(Axis::cp, 8, 100, 0, L) == 8);
    CHECK(hidden_seconds(Axis::cp, 8, 3, 0, L) == 3);
    CHECK(hidden_seconds(Axis::ep, 8, 100, 0, L, 4) == 6);
    L.overlap = false;
    CHECK(hidden_seconds(Axis::cp, 8, 100, 0, L) == 0);
  }

  TEST_CASE("ranks sharing a node's cores take turns at the computation") {
    const ModelSpec m = tiny();
    ClusterSpec c = a100();
    c.achieved_tflops = 1e-9;
    const Layout L{.mesh = {.pp = 2, .dp = 2, .tp = 2}, .microbatches = 4};
    const double own = step_time(m, c, L).compute_s;
    c.cores_per_node = 2;  // 8 ranks a node, 2 cores
    CHECK_MESSAGE(step_time(m, c, L).compute_s == doctest::Approx(own * 4), "8 ranks on 2 cores");
    c.gpus_per_node = 4;  // 4 ranks a node, 2 cores
    CHECK(step_time(m, c, L).compute_s == doctest::Approx(own * 2));
    c.cores_per_node = 8;  // more cores than ranks: no turns
    CHECK(step_time(m, c, L).compute_s == doctest::Approx(own));
  }

  TEST_CASE("a machine profile: Hockney's fit, the nearest shape, JSON both ways, the cluster") {
    // t = 2 us + S / (4 GB/s), exactly, at three sizes.
    const LinkFit fit =
        fit_link({{1e3, 2e-6 + 1e3 / 4e9}, {1e5, 2e-6 + 1e5 / 4e9}, {1e6, 2e-6 + 1e6 / 4e9}});
    CHECK(fit.alpha_s == doctest::Approx(2e-6));
    CHECK(fit.beta_GBps == doctest::Approx(4));
    CHECK(fit.seconds(4e9) == doctest::Approx(1 + 2e-6));
    CHECK(fit.seconds(0) == 0);
    CHECK_THROWS(fit_link({{1e3, 1.0}}));

    MachineProfile p;
    p.cpu = "test cpu";
    p.cores = 2;
    p.clock_ghz = 3;
    p.fp32_lanes = 16;
    p.memory_bytes = 8e9;
    p.gemm_gflops = 100;
    p.triad_GBps = 20;
    p.gemm = {{512, 128, 128, 40}, {512, 512, 128, 80}};
    p.costs = {{"block r512 t1 c1", 1e-3}};
    p.backend = "threads";
    p.ranks = 8;
    p.ranks_per_host = 8;
    p.ranks_per_machine = 8;
    p.links["allreduce"][2] = {.alpha_s = 1e-5, .beta_GBps = 2};
    p.links["allreduce"][8] = {.alpha_s = 3e-5, .beta_GBps = 1};
    CHECK_MESSAGE(p.peak_gflops() == 2 * 3 * 16 * 2 * 2, "cores x clock x lanes x FMA units x 2");
    CHECK(p.gemm_rate(500, 120, 130) == 40);
    CHECK(p.gemm_rate(512, 400, 128) == 80);
    CHECK(p.link("allreduce", 2).beta_GBps == 2);
    CHECK_MESSAGE(p.link("allreduce", 4).alpha_s == 1e-5,
                  "the nearest group, the smaller at a tie");
    CHECK(p.link("allreduce", 16).beta_GBps == 1);
    CHECK_THROWS(p.link("alltoall", 2));
    CHECK(p.cost("block r512 t1 c1") == 1e-3);
    CHECK_THROWS(p.cost("block r64 t1 c1"));

    const MachineProfile back = machine_from_json(to_json(p), "test");
    CHECK(back.cpu == p.cpu);
    CHECK(back.peak_gflops() == p.peak_gflops());
    CHECK(back.gemm.size() == 2);
    CHECK(back.costs == p.costs);
    CHECK(back.link("allreduce", 8).alpha_s == doctest::Approx(3e-5));
    CHECK(back.link("allreduce", 8).beta_GBps == 1);

    const ClusterSpec c = cluster_of(p);
    check_cluster(c);
    CHECK(c.gpus_per_node == 8);
    CHECK(c.cores_per_node == 2);
    CHECK(c.achieved_tflops == doctest::Approx(0.1));
    CHECK(c.peak_tflops == doctest::Approx(0.192));  // a core: 3 x 16 x 2 x 2
    CHECK(c.nvlink_GBps == 1);
    CHECK(c.network_GBps == 1);  // one host: the same link

    nlohmann::json j = to_json(p);
    j.erase("cores");
    CHECK_THROWS_AS(machine_from_json(j, "test"), UsageError);
    j = to_json(p);
    j["triad_GBps"] = -1;
    CHECK_THROWS_AS(machine_from_json(j, "test"), UsageError);
    j = to_json(p);
    j["links"]["allreduce"]["two"] = {{"alpha_us", 1}, {"beta_GBps", 1}};
    CHECK_THROWS_AS(machine_from_json(j, "test"), UsageError);
    CHECK_THROWS_AS(load_machine("/nonexistent/machine.json"), UsageError);

    // The ranks' core groups come back; one without the other, a group that is not there,
    // or a group for another number of ranks is refused.
    p.ranks = 4;
    p.core_group = {0, 1, 0, 1};
    p.group_cores = {1, 1};
    const MachineProfile pinned = machine_from_json(to_json(p), "test");
    CHECK(pinned.core_group == p.core_group);
    CHECK(pinned.group_cores == p.group_cores);
    CHECK(pinned.core_groups(4).turns() == 0.5);
    j = to_json(p);
    j.erase("group_cores");
    CHECK_THROWS_AS(machine_from_json(j, "test"), UsageError);
    j = to_json(p);
    j["core_group"] = {0, 2, 0, 1};
    CHECK_THROWS_AS(machine_from_json(j, "test"), UsageError);
    j = to_json(p);
    j["core_group"] = {0, 1};
    CHECK_THROWS_AS(machine_from_json(j, "test"), UsageError);
    j = to_json(p);
    j["group_cores"] = {1, 0};
    CHECK_THROWS_AS(machine_from_json(j, "test"), UsageError);
  }
}
