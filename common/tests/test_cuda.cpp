// GPU tests (CTest label `gpu`): every tensor operation on device memory against the same
// operation on the host, on random data; cuBLAS's matmul against the host matmul; layers
// (LayerNorm, attention and the loss included) and optimizers on the GPU against the host; the
// threads backend moving and reducing device buffers of every type for ranks that share one GPU;
// NCCL where there are GPUs for it. Without a CUDA device the program says "skipped: no CUDA
// device" and exits 77, which CTest reports as skipped — never passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "comm_cases.hpp"
#include "shardlab/comm_nccl.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/half.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::check_close;
using shardlab::testing::check_equal;

namespace {
/// The GPUs, for a test's skip decorator (evaluated before main, which reports a GPU that
/// CUDA cannot start).
int gpus() {
  try {
    return cuda::device_count();
  } catch (const Error&) {
    return 0;
  }
}
/// Float32 kernels and their host loops may round differently (the GPU fuses
/// multiply-adds, and its tanhf is within 2 ulp): a few ulp, relative.
constexpr float kernel_rtol = 4e-7f, kernel_atol = 1e-7f;
Tensor dev(const Tensor& t) { return t.to(Memory::device); }
Tensor host(const Tensor& t) { return t.to(Memory::host); }
/// The same model twice, built by `build` into a store of its own: on the host and on GPU 0.
struct Twins {
  nn::ParameterStore hs, ds;
  nn::Sequential hm, dm;
  template <class Build>
  explicit Twins(Build build) {
    build(hs, hm);
    build(ds, dm);
    hs.allocate(Memory::host);
    ds.allocate(Memory::device);
  }
};
}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("elementwise operations on the device match the host loops on random data") {
    cuda::set_device(0);
    const Tensor a = randn(37, 129, 1), b = randn(37, 129, 2);
    check_close(host(add(dev(a), dev(b))), add(a, b), kernel_atol, kernel_rtol, "add");
    check_close(host(sub(dev(a), dev(b))), sub(a, b), kernel_atol, kernel_rtol, "sub");
    check_close(host(mul(dev(a), dev(b))), mul(a, b), kernel_atol, kernel_rtol, "mul");
    Tensor y = dev(b), y_ref = b.clone();
    axpy(0.37f, dev(a), y);
    axpy(0.37f, a, y_ref);
    check_close(host(y), y_ref, kernel_atol, kernel_rtol, "axpy");
    check_close(host(scale(y, -2.5f)), scale(y_ref, -2.5f), kernel_atol, kernel_rtol, "scale");
    check_close(host(tanh(dev(a))), tanh(a), 1e-6f, 1e-6f, "tanh");
    check_close(host(tanh_backward(dev(tanh(a)), dev(b))), tanh_backward(tanh(a), b), 1e-6f, 1e-6f,
                "tanh backward");
    check_close(host(gelu(dev(a))), gelu(a), 1e-6f, 1e-5f, "gelu");
    check_close(host(gelu_backward(dev(a), dev(b))), gelu_backward(a, b), 1e-6f, 1e-5f,
                "gelu backward");
    const Tensor row = randn(1, 129, 3);
    Tensor z = dev(a), z_ref = a.clone();
    add_row(z, dev(row));
    add_row(z_ref, row);
    check_close(host(z), z_ref, kernel_atol, kernel_rtol, "add_row");
    check_equal(host(column_sums(dev(a))), column_sums(a), "column sums (same order)");
    CHECK(max_abs_diff(dev(a), dev(b)) == doctest::Approx(max_abs_diff(a, b)));
    CHECK(max_abs_diff(dev(a), dev(a)) == 0.0);
    CHECK(max_abs(dev(a)) == max_abs(a));
    Tensor bad = a.clone();
    bad(3, 4) = std::nanf("");
    CHECK(std::isnan(max_abs_diff(dev(bad), dev(a))));
    CHECK_FALSE(all_finite(dev(bad)));
    check_equal(host(transpose(dev(a))), transpose(a), "transpose");
    // Empty tensors: no kernel is launched with a grid of zero blocks.
    const Tensor none(0, 5);
    check_equal(host(add(dev(none), dev(none))), none, "add of empty tensors");
    Tensor empty_y = dev(none);
    axpy(1.0f, dev(none), empty_y);
    scale_in_place(empty_y, 2.0f);
    check_equal(host(column_sums(dev(none))), column_sums(none), "column sums of no rows");
  }

  TEST_CASE("views, shards, concat, fill and copies work the same in device memory") {
    cuda::set_device(0);
    const Tensor t = randn(Shape{5, 7, 3}, 4);
    const Tensor d = dev(t);
    for (int dim : {0, 1, 2})
      for (int p = 0; p < 3; ++p)
        check_equal(host(shard(d, 3, dim, p)), shard(t, 3, dim, p), "shard on the device");
    check_equal(host(concat(split(d, 3, 1), 1)), t, "concat(split) on the device");
    check_equal(host(d.slice(1, 2)), t.slice(1, 2), "a row slice of device memory");
    Tensor f(Shape{4, 4}, DType::f16, Memory::device);
    f.fill(3.0);
    check_equal(cast(host(f), DType::f32), full(4, 4, 3.0f), "fill of an f16 device tensor");
  }

  TEST_CASE("casts on the device match half.hpp bit for bit, every pair of types") {
    cuda::set_device(0);
    Tensor x = scale(randn(1, 4096, 9), 1000.0f);  // |x| up to a few thousand: all finite
    x[0] = 0x1.0p-25f;                             // ties to zero in fp16
    x[1] = 65519.0f;                               // largest that stays finite in fp16
    x[2] = -0x1.8p-25f;
    // Floating targets from random floats; integer targets from integers they can hold.
    const Tensor small = arange(256);
    for (DType type : {DType::f16, DType::bf16, DType::f64, DType::i32, DType::i64, DType::u8}) {
      CAPTURE(dtype_name(type));
      const Tensor& source = is_floating(type) ? x : small;
      const Tensor got = host(cast(dev(source), type));
      CHECK_MESSAGE(got.bitwise_equal(cast(source, type)), "cast f32 -> " << dtype_name(type));
      CHECK(host(cast(dev(got), DType::f32)).bitwise_equal(cast(got, DType::f32)));
    }
    x[5] = 70000.0f;  // overflows fp16 (not bf16)
    CHECK_FALSE(all_finite(cast(dev(x), DType::f16)));
    CHECK(all_finite(cast(dev(x), DType::bf16)));
  }

  TEST_CASE("cuBLAS matmul equals the host matmul within the summation-order bound") {
    cuda::set_device(0);
    for (auto [M, K, N] :
         {std::array<std::int64_t, 3>{4, 5, 8}, {1, 1, 1}, {65, 257, 33}, {128, 512, 64}}) {
      CAPTURE(M);
      CAPTURE(K);
      CAPTURE(N);
      const Tensor x = randn(M, K, 7), w = randn(K, N, 8);
      const float bound = matmul_reorder_bound(x, w);
      check_close(host(matmul(dev(x), dev(w))), matmul(x, w), bound, 0.0f, "x @ w");
      const Tensor xt = transpose(x), wt = transpose(w);
      check_close(host(matmul(dev(xt), dev(w), true, false)), matmul(x, w), bound, 0.0f,
                  "(x^T)^T @ w");
      check_close(host(matmul(dev(x), dev(wt), false, true)), matmul(x, w), bound, 0.0f,
                  "x @ (w^T)^T");
      check_close(host(matmul(dev(xt), dev(wt), true, true)), matmul(x, w), bound, 0.0f,
                  "both transposed");
      // f16 in and out, f32 accumulation: within one f16 rounding of the host's.
      const Tensor h = host(matmul(dev(cast(x, DType::f16)), dev(cast(w, DType::f16))));
      const Tensor h_ref = matmul(cast(x, DType::f16), cast(w, DType::f16));
      check_close(cast(h, DType::f32), cast(h_ref, DType::f32), bound * 2, 1e-3f, "f16 matmul");
    }
    const Tensor zero_k = host(matmul(dev(zeros(3, 0)), dev(zeros(0, 4))));
    check_equal(zero_k, zeros(3, 4), "K = 0 gives zeros");
  }

  TEST_CASE("gather and scatter-add of rows by index, on the device") {
    cuda::set_device(0);
    const Tensor table = randn(10, 6, 11);
    const Tensor index = Tensor::from_vector<std::int64_t>({9, 0, 3, 3, 7});
    check_equal(host(index_rows(dev(table), dev(index))), index_rows(table, index), "gather");
    Tensor into = dev(zeros(10, 6)), into_ref = zeros(10, 6);
    const Tensor src = randn(5, 6, 12);
    scatter_add_rows(into, dev(index), dev(src));
    scatter_add_rows(into_ref, index, src);
    check_equal(host(into), into_ref, "scatter-add (same order)");
    CHECK_THROWS_AS(index_rows(dev(table), dev(Tensor::from_vector<std::int64_t>({10}))), Error);
  }

  TEST_CASE("layers, the loss and Adam on the GPU match the host") {
    cuda::set_device(0);
    auto build = [](nn::ParameterStore& store, nn::Sequential& model) {
      model.add<nn::Linear>(store, "l1", 17, 9, 5);
      model.add<nn::Gelu>();
      model.add<nn::Linear>(store, "l2", 9, 4, 6);
    };
    Twins twins(build);
    nn::ParameterStore &hs = twins.hs, &ds = twins.ds;
    nn::Sequential &hm = twins.hm, &dm = twins.dm;
    const Tensor x = randn(33, 17, 13), dy = randn(33, 4, 14);
    nn::Forward hf = hm.forward(x), df = dm.forward(dev(x));
    check_close(host(df.out), hf.out, 1e-5f, 1e-5f, "forward");
    (void)hm.backward(dy, hf.saved);
    (void)dm.backward(dev(dy), df.saved);
    check_close(host(ds.grads()), hs.grads(), 1e-5f, 1e-5f, "gradients");
    nn::Adam ha(hs.size(), {}, Memory::host), da(ds.size(), {}, Memory::device);
    for (int t = 0; t < 5; ++t) {
      ha.step(hs.values(), hs.grads());
      da.step(ds.values(), ds.grads());
    }
    check_close(host(ds.values()), hs.values(), 1e-5f, 1e-5f, "Adam after 5 steps");
  }

  // The layers below follow the host loops step for step (cuda.cu); only sums taken in
  // parallel and the GPU's expf round differently, so every element agrees to 1e-5, relative
  // (1e-5 absolute next to zero).
  TEST_CASE("LayerNorm on the GPU matches the host: y, mean, rstd, dx, dgamma and dbeta") {
    cuda::set_device(0);
    // 300 rows (not a multiple of a block of threads) of 45; 3 rows of 1000 (more channels
    // than threads in a block).
    for (auto [rows, C] : {std::array<std::int64_t, 2>{300, 45}, {3, 1000}, {1, 1}}) {
      CAPTURE(rows);
      CAPTURE(C);
      nn::ParameterStore hs, ds;
      nn::LayerNorm hl(hs, "ln", C), dl(ds, "ln", C);
      hs.allocate(Memory::host);
      ds.allocate(Memory::device);
      // gamma and beta away from 1 and 0, and gradients that already hold something: the
      // backward adds to them.
      const Tensor values = randn(Shape{hs.size()}, 21), grads = randn(Shape{hs.size()}, 22);
      hs.values().copy_from(values);
      ds.values().copy_from(values);
      hs.grads().copy_from(grads);
      ds.grads().copy_from(grads);
      const Tensor x = add(scale(randn(rows, C, 23), 3.0f), full(rows, C, 0.5f));
      const Tensor dy = randn(rows, C, 24);
      nn::Forward hf = hl.forward(x), df = dl.forward(dev(x));
      check_close(host(df.out), hf.out, 1e-5f, 1e-5f, "LayerNorm y");
      check_close(host(df.saved.tensors.at(1)), hf.saved.tensors.at(1), 1e-5f, 1e-5f, "mean");
      check_close(host(df.saved.tensors.at(2)), hf.saved.tensors.at(2), 1e-5f, 1e-5f, "rstd");
      const Tensor hdx = hl.backward_input(dy, hf.saved);
      const Tensor ddx = dl.backward_input(dev(dy), df.saved);
      check_close(host(ddx), hdx, 1e-5f, 1e-5f, "LayerNorm dx");
      hl.backward_weight(hf.saved);
      dl.backward_weight(df.saved);
      check_close(host(ds.grads()), hs.grads(), 1e-5f, 1e-5f, "dgamma and dbeta, added to grads");
    }
    // dy in other memory than x is refused, as is x on the GPU with parameters on the host.
    nn::ParameterStore store;
    nn::LayerNorm ln(store, "ln", 6);
    store.allocate(Memory::device);
    nn::Forward f = ln.forward(dev(randn(4, 6, 25)));
    CHECK_THROWS_AS((void)ln.backward_input(randn(4, 6, 26), f.saved), Error);
    nn::ParameterStore host_store;
    nn::LayerNorm host_ln(host_store, "ln", 6);
    host_store.allocate(Memory::host);
    CHECK_THROWS_AS((void)host_ln.forward(dev(randn(4, 6, 25))), Error);
  }

  TEST_CASE("causal self-attention on the GPU matches the host: y, the weights and dx") {
    cuda::set_device(0);
    // B, T, C, H: sizes that are not round; a sequence longer than a block of threads; T = 1.
    for (auto [B, T, C, H] :
         {std::array<std::int64_t, 4>{2, 7, 12, 3}, {1, 300, 8, 2}, {3, 1, 6, 2}}) {
      CAPTURE(B);
      CAPTURE(T);
      CAPTURE(C);
      CAPTURE(H);
      const nn::CausalSelfAttention attention(H, T);
      const Tensor x = randn(B * T, 3 * C, 31), dy = randn(B * T, C, 32);
      nn::Forward hf = attention.forward(x), df = attention.forward(dev(x));
      check_close(host(df.out), hf.out, 1e-5f, 1e-5f, "attention y");
      check_close(host(df.saved.tensors.at(1)), hf.saved.tensors.at(1), 1e-5f, 1e-5f,
                  "attention weights (zero past each token)");
      const Tensor hdx = attention.backward_input(dy, hf.saved);
      const Tensor ddx = attention.backward_input(dev(dy), df.saved);
      check_close(host(ddx), hdx, 1e-5f, 1e-5f, "attention dx (q, k and v of every head)");
    }
  }

  TEST_CASE("cross_entropy on the GPU matches the host: the loss, the softmax, the gradient") {
    cuda::set_device(0);
    const std::int64_t B = 37, V = 301;
    const Tensor logits = scale(randn(B, V, 41), 4.0f);
    std::vector<std::int64_t> ids;
    std::vector<std::int32_t> ids32;
    for (std::int64_t i = 0; i < B; ++i) {
      ids.push_back((i * 113 + 7) % V);
      ids32.push_back(static_cast<std::int32_t>(ids.back()));
    }
    for (const Tensor& targets : {Tensor::from_vector(ids), Tensor::from_vector(ids32)}) {
      CAPTURE(dtype_name(targets.dtype()));
      const nn::Loss h = nn::cross_entropy(logits, targets);
      const nn::Loss d = nn::cross_entropy(dev(logits), dev(targets));
      CHECK(d.value == doctest::Approx(h.value).epsilon(1e-5));
      check_close(host(d.saved.tensors.at(0)), h.saved.tensors.at(0), 1e-7f, 1e-5f, "softmax");
      const Tensor grad = host(nn::cross_entropy_backward(d.saved));
      check_close(grad, nn::cross_entropy_backward(h.saved), 1e-7f, 1e-5f, "dL/dlogits");
      // From the same probabilities, the host's gradient bit for bit.
      nn::Saved same;
      same.tensors = {host(d.saved.tensors.at(0)), targets};
      check_equal(grad, nn::cross_entropy_backward(same), "dL/dlogits from the same softmax");
    }
    // A class id outside 0..V-1 is refused with the host's message; targets on the host with
    // logits on the GPU are refused.
    ids[5] = V;
    CHECK_THROWS_WITH_AS(nn::cross_entropy(dev(logits), dev(Tensor::from_vector(ids))),
                         doctest::Contains("target[5] = 301 is outside 0..300"), Error);
    CHECK_THROWS_AS(nn::cross_entropy(dev(logits), Tensor::from_vector(ids32)), Error);
    const nn::Loss none =
        nn::cross_entropy(dev(zeros(0, 5)), dev(Tensor::from_vector(ids).slice(0, 0)));
    CHECK(none.value == 0.0);
  }

  TEST_CASE("a small transformer's loss and gradients on the GPU match the host") {
    cuda::set_device(0);
    // Tokens -> embedding -> qkv -> attention -> LayerNorm -> logits: 2 sequences of 7.
    const std::int64_t B = 2, T = 7, C = 12, H = 3, V = 11;
    auto build = [&](nn::ParameterStore& store, nn::Sequential& model) {
      model.add<nn::Embedding>(store, "wte", V, C, 51, 1.0f);
      model.add<nn::Linear>(store, "qkv", C, 3 * C, 52);
      model.add<nn::CausalSelfAttention>(H, T);
      model.add<nn::LayerNorm>(store, "ln", C);
      model.add<nn::Linear>(store, "head", C, V, 53);
    };
    Twins twins(build);
    nn::ParameterStore &hs = twins.hs, &ds = twins.ds;
    nn::Sequential &hm = twins.hm, &dm = twins.dm;
    std::vector<std::int64_t> tokens, next;
    for (std::int64_t i = 0; i < B * T; ++i) {
      tokens.push_back((i * 5 + 3) % V);
      next.push_back((i * 7 + 1) % V);
    }
    const Tensor x = Tensor::from_vector(tokens), y = Tensor::from_vector(next);
    nn::Forward hf = hm.forward(x), df = dm.forward(dev(x));
    check_close(host(df.out), hf.out, 1e-5f, 1e-5f, "logits");
    const nn::Loss hl = nn::cross_entropy(hf.out, y), dl = nn::cross_entropy(df.out, dev(y));
    CHECK(dl.value == doctest::Approx(hl.value).epsilon(1e-5));
    (void)hm.backward(nn::cross_entropy_backward(hl.saved), hf.saved);
    (void)dm.backward(nn::cross_entropy_backward(dl.saved), df.saved);
    check_close(host(ds.grads()), hs.grads(), 1e-5f, 1e-5f, "every parameter's gradient");
  }

  TEST_CASE("the threads backend reduces and moves device buffers of every type, one GPU") {
    for (int n : {1, 2, 3, 4}) {
      CAPTURE(n);
      run_threads(n, [](Communicator& comm) {
        cuda::set_device(0);
        // Every reduction of every type, on device tensors, against the host backend.
        for (DType type :
             {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::u8})
          for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
            const Tensor mine =
                cast(cast(scale(randn(1, 1001, 50 + static_cast<std::uint64_t>(comm.rank())), 8.0f),
                          DType::i32),
                     type);
            Tensor on_host = mine.clone(), on_device = dev(mine);
            comm.allreduce(on_host, op);
            comm.allreduce(on_device, op);
            CHECK_MESSAGE(host(on_device).bitwise_equal(on_host), dtype_name(type)
                                                                      << " " << reduce_op_name(op));
          }
        // reduce_scatter with uneven shards, and empty shards (count < ranks).
        for (std::int64_t count : {std::int64_t{2}, std::int64_t{1001}}) {
          const Tensor in = randn(1, count, 60 + static_cast<std::uint64_t>(comm.rank()));
          const std::int64_t mine = shard_range(count, comm.size(), comm.rank()).length;
          Tensor out_host(mine), out_dev = dev(Tensor(mine));
          comm.reduce_scatter(in, out_host);
          comm.reduce_scatter(dev(in), out_dev);
          CHECK(host(out_dev).bitwise_equal(out_host));
        }
        // A ring of sendrecvs between device buffers.
        const int n2 = comm.size();
        const Tensor mine = randn(1, 1001, 50 + static_cast<std::uint64_t>(comm.rank()));
        Tensor in = dev(Tensor(1, 1001));
        comm.sendrecv(dev(mine), (comm.rank() + 1) % n2, in, (comm.rank() + n2 - 1) % n2);
        CHECK(host(in).bitwise_equal(
            randn(1, 1001, 50 + static_cast<std::uint64_t>((comm.rank() + n2 - 1) % n2))));
      });
    }
  }

  TEST_CASE("the threads backend with ranks on different GPUs" * doctest::skip(gpus() < 2)) {
    const int n = cuda::device_count();
    run_threads(n, [](Communicator& comm) {
      cuda::set_device(comm.rank());
      const Tensor mine = randn(1, 4099, 80 + static_cast<std::uint64_t>(comm.rank()));
      Tensor on_host = mine.clone(), on_device = dev(mine);
      comm.allreduce(on_host);
      comm.allreduce(on_device);
      CHECK(host(on_device).bitwise_equal(on_host));
    });
  }
}

TEST_CASE("NCCL: every collective and a sendrecv ring on device buffers, one GPU per rank" *
          doctest::skip(!nccl::available())) {
  const int n = cuda::device_count();
  run_threads(n, [n](Communicator& host_comm) {
    cuda::set_device(host_comm.rank());
    auto comm = nccl::create(host_comm, host_comm.rank());
    CHECK(comm->backend() == "nccl");
    const Tensor mine = randn(1, 4099, 70 + static_cast<std::uint64_t>(host_comm.rank()));
    Tensor expected = mine.clone();
    host_comm.allreduce(expected);
    Tensor d = dev(mine);
    comm->allreduce(d);
    check_close(host(d), expected, 1e-5f, 1e-6f, "NCCL allreduce");
    // Uneven allgather (one broadcast per rank), and a ring of device sendrecvs.
    std::vector<std::size_t> counts;
    for (int q = 0; q < n; ++q) counts.push_back(static_cast<std::size_t>(q + 1));
    Tensor all = dev(Tensor(1, n * (n + 1) / 2));
    comm->allgatherv(dev(full(1, host_comm.rank() + 1, static_cast<float>(host_comm.rank()))), all,
                     counts);
    CHECK(host(all)[static_cast<std::int64_t>(n * (n + 1) / 2 - 1)] == static_cast<float>(n - 1));
    Tensor in = dev(Tensor(1, 4099));
    comm->sendrecv(dev(mine), (host_comm.rank() + 1) % n, in, (host_comm.rank() + n - 1) % n);
    CHECK(host(in).bitwise_equal(
        randn(1, 4099, 70 + static_cast<std::uint64_t>((host_comm.rank() + n - 1) % n))));
    // Split communicators (the split settles on the parent first), and a send on one
    // answered by a receive that waits on another, as pipeline stages do: the wait on the
    // second must issue the first's pending send.
    auto forward = comm->split(0, host_comm.rank());
    auto backward = comm->split(0, host_comm.rank());
    Tensor again = dev(mine);
    forward->allreduce(again);
    check_close(host(again), expected, 1e-5f, 1e-6f, "allreduce on a split communicator");
    if (n >= 2 && host_comm.rank() < 2) {
      const Tensor to_send = randn(1, 513, 90 + static_cast<std::uint64_t>(host_comm.rank()));
      const Tensor out = dev(to_send);  // alive until the send is waited for
      Tensor got = dev(Tensor(1, 513));
      if (host_comm.rank() == 0) {
        Request sent = forward->isend(out, 1);
        backward->recv(got, 1);
        forward->wait(sent);
      } else {
        forward->recv(got, 0);
        backward->send(out, 0);
      }
      CHECK(host(got).bitwise_equal(
          randn(1, 513, 90 + static_cast<std::uint64_t>(1 - host_comm.rank()))));
    }
    // Host buffers on the same communicator go through the host backend: the full suite.
    cases::allreduce_every_op_and_type(*comm);
    cases::reduce_scatter_uneven_shards(*comm);
    cases::alltoall_every_type(*comm);
    CHECK(comm->all_true(true));
  });
}

int main(int argc, char** argv) {
  // Skipped only where there is no GPU at all; a GPU that CUDA cannot start fails.
  int devices = 0;
  try {
    devices = cuda::device_count();
  } catch (const Error& e) {
    std::fprintf(stderr, "test_cuda: %s\n", e.what());
    return 1;
  }
  if (devices == 0) {
    std::printf("skipped: no CUDA device%s\n", cuda::built() ? "" : " (this build has no CUDA)");
    return 77;
  }
  // SHARDLAB_TEST_GPUS=2: the multi-GPU run (CTest common.cuda_2gpus), skipped with fewer.
  if (const char* need = std::getenv("SHARDLAB_TEST_GPUS"); need && devices < std::atoi(need)) {
    std::printf("skipped: needs %s GPUs, this machine has %d\n", need, devices);
    return 77;
  }
  std::printf("device 0: %s\n", cuda::describe_device(0).c_str());
  doctest::Context context(argc, argv);
  return context.run();
}
