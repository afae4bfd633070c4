// GPU tests (CTest label `gpu`): every kernel against its CPU reference on random data,
// cuBLAS's matmul against the CPU matmul, and the threads backend moving and reducing
// device buffers for ranks that share one GPU. Without a CUDA device the program says
// "skipped: no CUDA device" and exits 77, which CTest reports as skipped — never passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "shardlab/comm_nccl.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/half.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::check_close;

namespace {
/// Float32 kernels and their CPU references may round differently (the GPU fuses
/// multiply-adds, and its tanhf is within 2 ulp): a few ulp, relative.
constexpr float kernel_rtol = 4e-7f, kernel_atol = 1e-7f;
}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("elementwise kernels match their CPU references on random data") {
    cuda::set_device(0);
    const Tensor a = randn(37, 129, 1), b = randn(37, 129, 2);
    const auto da = cuda::DeviceTensor::to_device(a), db = cuda::DeviceTensor::to_device(b);
    check_close(cuda::add(da, db).to_host(), add(a, b), kernel_atol, kernel_rtol, "add");
    auto y = cuda::DeviceTensor::to_device(b);
    cuda::axpy(0.37f, da, y);
    Tensor y_ref = b;
    axpy(0.37f, a, y_ref);
    check_close(y.to_host(), y_ref, kernel_atol, kernel_rtol, "axpy");
    cuda::scale(y, -2.5f);
    check_close(y.to_host(), scale(y_ref, -2.5f), kernel_atol, kernel_rtol, "scale");
    const auto t = cuda::tanh_forward(da);
    check_close(t.to_host(), nn::tanh_forward(a), 1e-6f, 1e-6f, "tanh");
    check_close(cuda::tanh_backward(t, db).to_host(), nn::tanh_backward(t.to_host(), b), 1e-6f,
                1e-6f, "tanh backward");
    CHECK(cuda::max_abs_diff(da, db) == doctest::Approx(max_abs_diff(a, b)));
    CHECK(cuda::max_abs_diff(da, da) == 0.0f);
  }

  TEST_CASE("fp16 and bf16 cast kernels match half.hpp bit for bit and flag inf/NaN") {
    cuda::set_device(0);
    Tensor x = scale(randn(1, 4096, 9), 1000.0f);  // |x| up to a few thousand: all finite
    x[0] = 0x1.0p-25f;                             // ties to zero in fp16
    x[1] = 65519.0f;                               // largest that stays finite in fp16
    x[2] = -0x1.8p-25f;
    for (cuda::HalfKind kind : {cuda::HalfKind::fp16, cuda::HalfKind::bf16}) {
      CAPTURE(static_cast<int>(kind));
      bool nonfinite = true;
      const auto halves = cuda::cast_to_half(cuda::DeviceTensor::to_device(x), kind, &nonfinite);
      CHECK_FALSE(nonfinite);
      const std::vector<std::uint16_t> got = halves.to_host();
      for (std::int64_t i = 0; i < x.size(); ++i) {
        const std::uint16_t want =
            kind == cuda::HalfKind::fp16 ? float_to_half_bits(x[i]) : float_to_bf16_bits(x[i]);
        if (got[static_cast<std::size_t>(i)] != want) {
          FAIL_CHECK("element " << i << " (" << x[i] << "): got 0x" << std::hex
                                << got[static_cast<std::size_t>(i)] << ", want 0x" << want);
          break;
        }
      }
      const Tensor back = cuda::cast_to_float(halves).to_host();
      for (std::int64_t i = 0; i < x.size(); ++i) {
        const std::uint16_t h = got[static_cast<std::size_t>(i)];
        REQUIRE(back[i] ==
                (kind == cuda::HalfKind::fp16 ? half_bits_to_float(h) : bf16_bits_to_float(h)));
      }
    }
    // 70000 overflows fp16 (not bf16); the flag says so.
    x[5] = 70000.0f;
    bool nonfinite = false;
    (void)cuda::cast_to_half(cuda::DeviceTensor::to_device(x), cuda::HalfKind::fp16, &nonfinite);
    CHECK(nonfinite);
    (void)cuda::cast_to_half(cuda::DeviceTensor::to_device(x), cuda::HalfKind::bf16, &nonfinite);
    CHECK_FALSE(nonfinite);
  }

  TEST_CASE("the Adam kernel matches the CPU Adam over several steps") {
    cuda::set_device(0);
    nn::Parameter p(randn(8, 33, 3));
    nn::AdamState state;
    auto dp = cuda::DeviceTensor::to_device(p.value);
    cuda::DeviceTensor m(8, 33), v(8, 33);
    for (int t = 1; t <= 5; ++t) {
      p.grad = randn(8, 33, 100 + static_cast<std::uint64_t>(t));
      nn::adam_step(p, state, 1e-2f);
      cuda::adam_step(dp, cuda::DeviceTensor::to_device(p.grad), m, v, 1e-2f, 0.9f, 0.999f, 1e-8f,
                      t);
    }
    check_close(dp.to_host(), p.value, 1e-6f, 1e-5f, "Adam after 5 steps");
  }

  TEST_CASE("cuBLAS matmul equals the CPU matmul within the summation-order bound") {
    cuda::set_device(0);
    for (auto [M, K, N] :
         {std::array<std::int64_t, 3>{4, 5, 8}, {1, 1, 1}, {65, 257, 33}, {128, 512, 64}}) {
      CAPTURE(M);
      CAPTURE(K);
      CAPTURE(N);
      const Tensor x = randn(M, K, 7), w = randn(K, N, 8);
      const Tensor got =
          cuda::matmul(cuda::DeviceTensor::to_device(x), cuda::DeviceTensor::to_device(w))
              .to_host();
      check_close(got, matmul(x, w), matmul_reorder_bound(x, w), 0.0f, "cuBLAS x @ w");
    }
  }

  TEST_CASE("transposed matmuls, bias rows and column sums match their CPU references") {
    cuda::set_device(0);
    const Tensor x = randn(33, 17, 11), dy = randn(33, 9, 12), w = randn(17, 9, 13);
    const auto dx = cuda::DeviceTensor::to_device(x), ddy = cuda::DeviceTensor::to_device(dy),
               dw = cuda::DeviceTensor::to_device(w);
    const Tensor xt = transpose(x), wt = transpose(w);
    check_close(cuda::matmul(dx, ddy, true, false).to_host(), matmul(xt, dy),
                matmul_reorder_bound(xt, dy), 0.0f, "x^T @ dy");
    check_close(cuda::matmul(ddy, dw, false, true).to_host(), matmul(dy, wt),
                matmul_reorder_bound(dy, wt), 0.0f, "dy @ w^T");
    check_close(cuda::matmul(cuda::DeviceTensor::to_device(xt), dx, false, false).to_host(),
                matmul(xt, x), matmul_reorder_bound(xt, x), 0.0f, "x^T @ x");
    // A Linear layer forward and its bias gradient, against nn::Linear on the CPU.
    nn::Linear layer(17, 9, 5);
    const Tensor y = layer.forward(x);
    auto dy_dev = cuda::matmul(dx, cuda::DeviceTensor::to_device(layer.weight.value));
    cuda::add_row(dy_dev, cuda::DeviceTensor::to_device(layer.bias.value));
    check_close(dy_dev.to_host(), y, matmul_reorder_bound(x, layer.weight.value), 1e-6f,
                "x @ W + b");
    layer.backward(dy);
    check_close(cuda::column_sums(ddy).to_host(), layer.bias.grad, 0.0f, 0.0f,
                "bias gradient (same order)");
  }

  TEST_CASE("the threads backend allreduces and passes device buffers between ranks on one GPU") {
    for (int n : {1, 2, 3, 4}) {
      CAPTURE(n);
      run_threads(n, [n](Communicator& comm) {
        cuda::set_device(0);
        const Tensor mine = randn(1, 1001, 50 + static_cast<std::uint64_t>(comm.rank()));
        Tensor host = mine;
        auto dev = cuda::DeviceTensor::to_device(mine);
        comm.allreduce(host);
        comm.allreduce(dev);
        CHECK(dev.to_host().bitwise_equal(host));  // the same rank-order sums, in kernels
        // A ring of sendrecvs between device buffers.
        cuda::DeviceTensor in(1, 1001);
        comm.sendrecv(cuda::DeviceTensor::to_device(mine), (comm.rank() + 1) % n, in,
                      (comm.rank() + n - 1) % n);
        CHECK(in.to_host().bitwise_equal(
            randn(1, 1001, 50 + static_cast<std::uint64_t>((comm.rank() + n - 1) % n))));
      });
    }
  }
}

TEST_CASE("NCCL: collectives and a sendrecv ring on device buffers equal the host results" *
          doctest::skip(!nccl::available())) {
  const int n = cuda::device_count();  // one GPU per rank
  run_threads(n, [n](Communicator& host) {
    cuda::set_device(host.rank());
    auto comm = nccl::create(host, host.rank());
    CHECK(comm->backend() == "nccl");
    const Tensor mine = randn(1, 4099, 70 + static_cast<std::uint64_t>(host.rank()));
    Tensor expected = mine;
    host.allreduce(expected);
    auto dev = cuda::DeviceTensor::to_device(mine);
    comm->allreduce(dev);
    check_close(dev.to_host(), expected, 1e-5f, 1e-6f, "NCCL allreduce");
    // Uneven allgather (one broadcast per rank), and a ring of device sendrecvs.
    std::vector<std::size_t> counts;
    for (int q = 0; q < n; ++q) counts.push_back(static_cast<std::size_t>(q + 1));
    cuda::DeviceTensor all(1, n * (n + 1) / 2);
    comm->allgatherv(
        cuda::DeviceTensor::to_device(full(1, host.rank() + 1, static_cast<float>(host.rank()))),
        all, counts);
    CHECK(all.to_host()[static_cast<std::int64_t>(n * (n + 1) / 2 - 1)] ==
          static_cast<float>(n - 1));
    cuda::DeviceTensor in(1, 4099);
    comm->sendrecv(cuda::DeviceTensor::to_device(mine), (host.rank() + 1) % n, in,
                   (host.rank() + n - 1) % n);
    CHECK(in.to_host().bitwise_equal(
        randn(1, 4099, 70 + static_cast<std::uint64_t>((host.rank() + n - 1) % n))));
    // Host buffers on the same communicator go through the host backend.
    CHECK(comm->all_true(true));
  });
}

int main(int argc, char** argv) {
  if (cuda::device_count() == 0) {
    std::printf("skipped: no CUDA device%s\n", cuda::built() ? "" : " (this build has no CUDA)");
    return 77;
  }
  std::printf("device 0: %s\n", cuda::describe_device(0).c_str());
  doctest::Context context(argc, argv);
  return context.run();
}
