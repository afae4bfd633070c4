// Chapter 08 tests: compiled against the solution (must pass) and the exercise stubs (every
// case must fail). The mesh against Megatron-LM's documented example and a second mesh
// written out by hand; f and g on their own; a Megatron MLP block made of them against the
// same block on one device; the 3-D mesh's communicators on real ranks; and last the 3-D
// training on them (on the learner's chapters 02, 04 and 05 in the learner build: a stub
// there is named by `make check` as the chapter to do first).
//
// The coordinates run first: the groups are made of them, so a wrong coords_of or rank_of
// is named before it shows as wrong groups.
//
// Wrong versions these tests were checked against (each fails with the message shown):
//   - axis order swapped in coords_of (pp fastest): "CHECK( coords_of({.pp = 2, .dp = 2,
//     .tp = 2}, 6) == Coords{.pp = 1, .dp = 1, .tp = 0} )" with the values "(pp 0, dp 1, ep 0, cp
//     0, tp 1) == (pp 1, dp 1, ep 0, cp 0, tp 0)";
//   - rank_of with the dp stride tp * pp (pp before dp): "rank_of(coords_of(2)) is 4, not
//     2" on the 2 x 2 x 2 mesh;
//   - groups ordered by rank within but the groups in another order (by last rank): the
//     listed groups differ; a group built with the axis' size off by one: a group of 1
//     rank too few (the dropped last member);
//   - cp and ep swapped in coords_of (ep faster than cp): "coords_of(1) is (pp 0, dp 0, ep
//     1, cp 0, tp 0), which Megatron-LM's order makes rank 2" (sizes 1 x 2 x 2 x 2 x 1);
//   - ep carved from dp's slow end (dp faster than ep): "coords_of(2) is (pp 0, dp 1, ep 0,
//     cp 0, tp 0), which Megatron-LM's order makes rank 4";
//   - coords_of written for three axes (cp and ep left at 0): "coords_of(1) is (pp 0, dp
//     1, ep 0, cp 0, tp 0), which Megatron-LM's order makes rank 4";
//   - allreduce in both f and g: f's forward doubles x ("f_forward: x on return (the
//     header: ...)"); and the block's output is tp times too large;
//   - identity in both: g_forward leaves the partial sum; the block differs for tp > 1;
//   - f and g swapped (allreduce in f's forward, g's backward): named by the f/g case;
//   - f_backward averaging (allreduce then / tp) instead of summing: dL/dx differs.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "mesh.hpp"
#include "mlp_stack.hpp"
#include "shardlab/testing.hpp"
#include "tensor_parallel.hpp"

using namespace shardlab;
using namespace ch08;
using Groups = std::vector<std::vector<int>>;
using shardlab::testing::check_close;
using shardlab::testing::on_ranks;

namespace {

std::string show(const Groups& gs) {
  std::string out;
  for (const auto& g : gs) {
    out += "[";
    for (std::size_t i = 0; i < g.size(); ++i) out += (i ? ", " : "") + std::to_string(g[i]);
    out += "] ";
  }
  return out;
}

/// "2 x 2 x 2", or with cp or ep "1 x 2 x 2 x 2 x 2" (pp x dp x ep x cp x tp).
std::string sizes(const MeshShape& s) {
  const bool five = s.cp > 1 || s.ep > 1;
  return std::to_string(s.pp) + " x " + std::to_string(s.dp) + " x " +
         (five ? std::to_string(s.ep) + " x " + std::to_string(s.cp) + " x " : "") +
         std::to_string(s.tp);
}

void check_groups(const MeshShape& shape, Axis axis, const Groups& want) {
  const Groups got = groups(shape, axis);
  CHECK_MESSAGE(got == want, std::string(axis_name(axis))
                                 << " groups of the " << sizes(shape) << " mesh: got " << show(got)
                                 << "; expected " << show(want));
}

/// The rank of `c`, written out independently of the code under test:
/// rank = (((pp_i dp + dp_i) ep + ep_i) cp + cp_i) tp + tp_i.
int megatron_rank(const MeshShape& s, const Coords& c) {
  return (((c.pp * s.dp + c.dp) * s.ep + c.ep) * s.cp + c.cp) * s.tp + c.tp;
}

const std::vector<MeshShape> shapes = {{.pp = 1, .dp = 1, .tp = 1},
                                       {.pp = 2, .dp = 2, .tp = 2},
                                       {.pp = 4, .dp = 2, .tp = 2},
                                       {.pp = 1, .dp = 2, .tp = 8},
                                       {.pp = 3, .dp = 1, .tp = 2},
                                       {.pp = 2, .dp = 3, .tp = 1},
                                       {.pp = 1, .dp = 1, .tp = 5},
                                       {.pp = 5, .dp = 1, .tp = 1},
                                       {.pp = 2, .dp = 3, .tp = 4},
                                       {.pp = 8, .dp = 1, .tp = 1},
                                       {.pp = 1, .dp = 2, .ep = 2, .cp = 2, .tp = 1},
                                       {.pp = 2, .dp = 1, .ep = 1, .cp = 2, .tp = 2},
                                       {.pp = 1, .dp = 1, .ep = 1, .cp = 8, .tp = 1},
                                       {.pp = 1, .dp = 3, .ep = 2, .cp = 1, .tp = 2},
                                       {.pp = 2, .dp = 2, .ep = 2, .cp = 2, .tp = 3},
                                       {.pp = 1, .dp = 1, .ep = 5, .cp = 1, .tp = 1}};

}  // namespace

namespace doctest {
/// A failed CHECK on coordinates prints them: "(pp 1, dp 0, ep 0, cp 0, tp 1)".
template <>
struct StringMaker<ch08::Coords> {
  static String convert(const ch08::Coords& c) {
    std::string out;
    for (Axis axis : kAxes)
      out += (out.empty() ? "(" : ", ") + std::string(axis_name(axis)) + " " +
             std::to_string(c.at(axis));
    return (out + ")").c_str();
  }
};
}  // namespace doctest

TEST_SUITE("ch08 mesh") {
  // First: the groups are made of coordinates and ranks, so a wrong coords_of or rank_of
  // is named here before it shows as wrong groups.
  TEST_CASE("coords_of: tp fastest, then cp, ep, dp, pp; rank_of is its inverse") {
    CHECK(coords_of({.pp = 2, .dp = 2, .tp = 2}, 5) == Coords{.pp = 1, .dp = 0, .tp = 1});
    CHECK(coords_of({.pp = 2, .dp = 2, .tp = 2}, 6) == Coords{.pp = 1, .dp = 1, .tp = 0});
    CHECK(coords_of({.pp = 4, .dp = 2, .tp = 2}, 13) == Coords{.pp = 3, .dp = 0, .tp = 1});
    CHECK(coords_of({.pp = 2, .dp = 3, .tp = 4}, 23) == Coords{.pp = 1, .dp = 2, .tp = 3});
    CHECK(coords_of({.pp = 2, .dp = 3, .tp = 4}, 4) == Coords{.pp = 0, .dp = 1, .tp = 0});
    for (const MeshShape& s : shapes)
      for (int r = 0; r < s.ranks(); ++r) {
        const Coords c = coords_of(s, r);
        CAPTURE(r);
        CAPTURE(sizes(s));
        for (Axis axis : kAxes)
          REQUIRE_MESSAGE((c.at(axis) >= 0 && c.at(axis) < s.size(axis)),
                          "coords_of(" << r << ") puts it at " << axis_name(axis) << " "
                                       << c.at(axis) << ", outside the mesh");
        REQUIRE_MESSAGE(megatron_rank(s, c) == r, "coords_of("
                                                      << r << ") is " << doctest::toString(c)
                                                      << ", which Megatron-LM's order makes rank "
                                                      << megatron_rank(s, c));
        REQUIRE_MESSAGE(rank_of(s, c) == r,
                        "rank_of(coords_of(" << r << ")) is " << rank_of(s, c) << ", not " << r);
      }
  }

  TEST_CASE("Megatron-LM's example: 16 GPUs, tp 2, pp 4 (dp 2) has its documented groups") {
    // megatron/core/parallel_state.py, initialize_model_parallel's docstring.
    const MeshShape shape{.pp = 4, .dp = 2, .tp = 2};
    check_groups(shape, Axis::tp,
                 {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
    check_groups(shape, Axis::dp,
                 {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
    check_groups(shape, Axis::pp, {{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
  }

  TEST_CASE("dp 2 x tp 8: two nodes of 8, tp inside each, dp across them") {
    const MeshShape shape{.pp = 1, .dp = 2, .tp = 8};
    check_groups(shape, Axis::tp, {{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}});
    check_groups(shape, Axis::dp,
                 {{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}});
    Groups alone;
    for (int r = 0; r < 16; ++r) alone.push_back({r});
    check_groups(shape, Axis::pp, alone);
  }

  TEST_CASE("five axes: tp fastest, then cp, ep, dp and pp; ep carved out of data parallelism") {
    // 16 ranks: tp 2, cp 2, ep 2, dp 2 (pp 1), written out by hand.
    const MeshShape shape{.pp = 1, .dp = 2, .ep = 2, .cp = 2, .tp = 2};
    check_groups(shape, Axis::tp,
                 {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
    check_groups(shape, Axis::cp,
                 {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
    check_groups(shape, Axis::ep,
                 {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}});
    check_groups(shape, Axis::dp,
                 {{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}});
    CHECK(coords_of(shape, 13) == Coords{.pp = 0, .dp = 1, .ep = 1, .cp = 0, .tp = 1});
    CHECK(coords_of({.pp = 1, .dp = 2, .ep = 2, .cp = 2, .tp = 1}, 5) ==
          Coords{.pp = 0, .dp = 1, .ep = 0, .cp = 1, .tp = 0});
    CHECK(rank_of(shape, Coords{.pp = 0, .dp = 1, .ep = 1, .cp = 1, .tp = 0}) == 14);
  }

  TEST_CASE("every rank is in exactly one group per axis, at its own coordinate") {
    for (const MeshShape& s : shapes)
      for (Axis axis : kAxes) {
        const Groups gs = groups(s, axis);
        CAPTURE(sizes(s));
        CAPTURE(axis_name(axis));
        REQUIRE_MESSAGE(
            static_cast<int>(gs.size()) == s.ranks() / s.size(axis),
            "there are " << gs.size() << " groups, expected " << s.ranks() / s.size(axis));
        std::vector<int> seen(static_cast<std::size_t>(s.ranks()), 0);
        for (const auto& g : gs) {
          REQUIRE_MESSAGE(static_cast<int>(g.size()) == s.size(axis),
                          "a group of " << g.size() << " ranks: " << show({g}));
          for (std::size_t i = 0; i < g.size(); ++i) {
            REQUIRE(g[i] >= 0);
            REQUIRE(g[i] < s.ranks());
            ++seen[static_cast<std::size_t>(g[i])];
            const Coords c = coords_of(s, g[i]), first = coords_of(s, g[0]);
            CHECK_MESSAGE(c.at(axis) == static_cast<int>(i),
                          "rank " << g[i] << " is at place " << i << " of its group " << show({g})
                                  << " but at coordinate " << c.at(axis));
            for (Axis other : kAxes)
              if (other != axis)
                CHECK_MESSAGE(c.at(other) == first.at(other),
                              show({g}) << " mixes ranks of different " << axis_name(other));
          }
        }
        for (int r = 0; r < s.ranks(); ++r)
          CHECK_MESSAGE(
              seen[static_cast<std::size_t>(r)] == 1,
              "rank " << r << " is in " << seen[static_cast<std::size_t>(r)] << " groups");
      }
  }

  TEST_CASE("f and g, forward and backward, each leave what the header promises") {
    for (int n : {1, 2, 3, 4}) {
      on_ranks(n, [n](Communicator& tp) {
        const int r = tp.rank();
        const Tensor mine = randn(3, 5, 10 + static_cast<std::uint64_t>(r));
        Tensor sum = zeros(3, 5);
        for (int q = 0; q < n; ++q)
          axpy(1.0f, randn(3, 5, 10 + static_cast<std::uint64_t>(q)), sum);
        Tensor t = mine.clone();
        f_forward(tp, t);
        check_close(t, mine, 0, 0,
                    "f_forward: x on return (the header: what this rank's columns of W multiply; "
                    "every rank was given all of x)");
        t = mine.clone();
        f_backward(tp, t);
        check_close(t, sum, 1e-6f, 1e-6f,
                    "f_backward: dL/dx on return (the header: the block's whole dL/dx, the same on "
                    "every tp rank)");
        t = mine.clone();
        g_forward(tp, t);
        check_close(
            t, sum, 1e-6f, 1e-6f,
            "g_forward: y on return (the header: the block's y, the same on every tp rank)");
        t = mine.clone();
        g_backward(tp, t);
        check_close(t, mine, 0, 0,
                    "g_backward: dL/dy on return (the header: what this rank's rows of W need; "
                    "every rank was given all of dL/dy)");
      });
    }
  }

  TEST_CASE("a Megatron MLP block on tp ranks equals the block on one device") {
    struct Case {
      int tp;
      std::int64_t hidden, ffn;
    };
    // tp = 1, 2, 4; the last two cut the inner width unevenly (10 over 4: 3, 3, 2, 2).
    for (const Case c :
         {Case{1, 6, 24}, Case{2, 6, 24}, Case{4, 8, 32}, Case{4, 6, 10}, Case{3, 5, 7}}) {
      CAPTURE(c.tp);
      CAPTURE(c.ffn);
      const Tensor x = randn(7, c.hidden, 21), dy = randn(7, c.hidden, 22);
      nn::ParameterStore ref_store;
      nn::Residual ref = mlp_block(ref_store, mlp_spec("b", c.hidden, c.ffn, 5, 0));
      ref_store.allocate();
      nn::Forward rf = ref.forward(x);
      const Tensor ref_dx = ref.backward(dy, rf.saved);
      auto& fc1 = dynamic_cast<nn::Linear&>(ref.inner()[0]);
      auto& fc2 = dynamic_cast<nn::Linear&>(ref.inner()[2]);
      on_ranks(c.tp, [&](Communicator& tp) {
        nn::ParameterStore store;
        nn::Residual block = parallel_mlp(store, tp, mlp_spec("b", c.hidden, c.ffn, 5, 0));
        store.allocate();
        nn::Forward f = block.forward(x);
        const Tensor dx = block.backward(dy, f.saved);
        check_close(f.out, rf.out, 1e-5f, 1e-5f, "the block's output y");
        check_close(dx, ref_dx, 1e-5f, 1e-5f, "dL/dx");
        auto& col = dynamic_cast<ColumnParallelLinear&>(block.inner()[0]);
        auto& row = dynamic_cast<RowParallelLinear&>(block.inner()[2]);
        const ShardRange cols = col.columns(), rows = row.rows();
        const auto part = [&](const Tensor& t) { return shard(t, tp.size(), 1, tp.rank()); };
        REQUIRE(cols.length == shard_range(c.ffn, tp.size(), tp.rank()).length);
        check_close(col.local().weight().grad, part(fc1.weight().grad), 1e-5f, 1e-5f,
                    "dL/dW1: this rank's columns");
        check_close(col.local().bias()->grad, part(fc1.bias()->grad), 1e-5f, 1e-5f,
                    "dL/db1: this rank's columns");
        check_close(row.local().weight().grad, fc2.weight().grad.slice(rows.offset, rows.length),
                    1e-5f, 1e-5f, "dL/dW2: this rank's rows");
        check_close(row.bias()->grad, fc2.bias()->grad, 1e-5f, 1e-5f,
                    "dL/db2 (whole on every rank, the bias added once after g)");
      });
    }
  }

  TEST_CASE("the mesh's communicators hold the groups, each rank at its coordinate") {
    for (const MeshShape shape :
         {MeshShape{.pp = 2, .dp = 2, .tp = 2}, MeshShape{.pp = 1, .dp = 2, .tp = 3},
          MeshShape{.pp = 3, .dp = 1, .tp = 1},
          MeshShape{.pp = 1, .dp = 2, .ep = 2, .cp = 2, .tp = 1},
          MeshShape{.pp = 2, .dp = 1, .ep = 1, .cp = 2, .tp = 2}}) {
      CAPTURE(sizes(shape));
      on_ranks(shape.ranks(), [&](Communicator& world) {
        Mesh mesh(world, shape);
        const Coords me = mesh.coords();
        CHECK(me == coords_of(shape, world.rank()));
        // The ranks of this rank's group across `axes`, in the mesh's order, from the
        // reference order written out again here.
        auto group_across = [&](std::vector<Axis> axes) {
          std::vector<std::int64_t> want;
          for (int r = 0; r < shape.ranks(); ++r) {
            Coords c = me;
            int rest = r;
            for (auto axis = axes.rbegin(); axis != axes.rend(); ++axis) {
              c.at(*axis) = rest % shape.size(*axis);
              rest /= shape.size(*axis);
            }
            if (rest == 0) want.push_back(megatron_rank(shape, c));
          }
          return want;
        };
        for (Axis axis : kAxes) {
          Communicator& comm = mesh.axis(axis);
          CHECK_MESSAGE(comm.gather_values(std::int64_t{world.rank()}) == group_across({axis}),
                        axis_name(axis)
                            << " communicator of rank " << world.rank() << " holds other ranks");
          CHECK(comm.rank() == me.at(axis));
        }
        CHECK_MESSAGE(
            mesh.replicas().gather_values(std::int64_t{world.rank()}) ==
                group_across({Axis::dp, Axis::ep, Axis::cp}),
            "the replicas of rank " << world.rank() << " are not the ranks with its pp and tp");
        CHECK_MESSAGE(mesh.expert_replicas().gather_values(std::int64_t{world.rank()}) ==
                          group_across({Axis::dp, Axis::cp}),
                      "the expert replicas of rank "
                          << world.rank() << " are not the ranks with its pp, ep and tp");
      });
    }
  }
  // Last, so that your own chapter's stubs are named first: the 3-D training runs on your
  // mesh and your f and g, and on the chapters below (in the learner build, your chapter
  // 02 sync, your 1F1B and your ZeRO-1 step).
  TEST_CASE("3-D training on your mesh (and your chapters 02, 04, 05) equals one device") {
    for (const int zero : {0, 1}) {
      HybridConfig c;
      c.mesh = {.pp = 2, .dp = 2, .tp = 2};
      c.blocks = 4;
      c.hidden = 8;
      c.ffn = 24;
      c.batch = 16;
      c.steps = 2;
      c.zero = zero;
      CAPTURE(zero);
      Reference ref;
      train_reference(c, ref);
      on_ranks(8, [&](Communicator& world) {
        Mesh mesh(world, c.mesh);
        HybridModel model(mesh, c, Memory::host);
        const HybridRun run = train_hybrid(mesh, model, c, Memory::host);
        for (std::size_t t = 0; t < run.loss.size(); ++t)
          CHECK_MESSAGE(std::abs(run.loss[t] - ref.loss[t]) <= 1e-5,
                        "step " << t + 1 << "'s loss: " << run.loss[t] << " on the mesh, "
                                << ref.loss[t] << " on one device");
        CHECK_MESSAGE(model.max_weight_diff(ref.model) <= 1e-5,
                      "rank " << world.rank() << "'s weights differ from one device's by "
                              << model.max_weight_diff(ref.model));
      });
    }
  }
}
