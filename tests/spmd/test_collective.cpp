// The SPMD all-reduce's phases (spmd/collective.hpp) and the planner's batches of them
// (graph/plan.hpp): devices that meet their collectives one by one and devices that batch
// them (publish all, combine all, release all) still meet, in any mix, and get the sums a
// scalar loop gives, in one result buffer they share, summed in chunks by whoever gets
// there; a member that fails before publishing stops its peers with an error instead of a
// hang, one that fails after publishing leaves them the whole sum, and a round or a whole
// step run again after such an error waits for the late member (counting each member once,
// and no failure of the first attempt against the second), and a device refusing its
// step leaves no other device unstepped, and one stopping with a step queued releases its
// peers; a data-parallel
// backward's gradient all-reduces run as one batch.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <latch>
#include <memory>
#include <string>
#include <thread>

#include <lazytensor/lazytensor.hpp>

#include "testing/spmd.hpp"

namespace spmd = lazy::spmd;
using lazy::spmd::Combine;
using lazy::spmd::detail::ReduceRound;

namespace {

constexpr std::int64_t kElements = 37;

// Member `slot`'s input to round `r`: distinct values per round and member.
float round_input(int r, int slot, std::int64_t i) { return static_cast<float>(r * 100 + slot * 10) + 0.25f * static_cast<float>(i); }

struct Round {
  std::vector<int> devices;  // members, in slot order
  Combine op;
  std::shared_ptr<ReduceRound> round;
};

std::vector<Round> make_rounds() {
  auto& reg = lazy::graph::DeviceRegistry::get();
  const std::vector<std::pair<std::vector<int>, Combine>> layout = {
      {{0, 1, 2}, Combine::Sum}, {{0, 1}, Combine::Max}, {{1, 2}, Combine::Sum}, {{2, 0, 1}, Combine::Min}, {{0, 2}, Combine::Sum}};
  std::vector<Round> rounds;
  for (const auto& [devices, op] : layout) {
    std::vector<lazy::graph::Device*> members;
    for (int d : devices) members.push_back(&reg.device(d));
    rounds.push_back(Round{devices, op, std::make_shared<ReduceRound>(op, members)});
  }
  return rounds;
}

float reference(const Round& r, int index, std::int64_t i) {
  float acc = round_input(index, 0, i);
  for (int s = 1; s < static_cast<int>(r.devices.size()); ++s) {
    const float v = round_input(index, s, i);
    if (r.op == Combine::Sum) acc += v;
    if (r.op == Combine::Max) acc = std::max(acc, v);
    if (r.op == Combine::Min) acc = std::min(acc, v);
  }
  return acc;
}

// How a device meets its rounds: one by one, all batched, or the first two batched.
enum class Style { OneByOne, Batched, Mixed };

// Runs device `d`'s part of `rounds` (in program order) the way `style` says; returns each
// of its results by round index.
std::vector<std::vector<float>> meet(int d, const std::vector<Round>& rounds, Style style) {
  auto& dev = lazy::graph::DeviceRegistry::get().device(d);
  std::vector<int> mine, slots;
  for (int r = 0; r < static_cast<int>(rounds.size()); ++r)
    for (int s = 0; s < static_cast<int>(rounds[static_cast<std::size_t>(r)].devices.size()); ++s)
      if (rounds[static_cast<std::size_t>(r)].devices[static_cast<std::size_t>(s)] == d) {
        mine.push_back(r);
        slots.push_back(s);
      }
  auto input = [&](std::size_t k) {
    auto buf = dev.pool().acquire(lazy::padded_bytes(kElements, sizeof(float)));
    auto* p = static_cast<float*>(buf->data());
    for (std::int64_t i = 0; i < kElements; ++i) p[i] = round_input(mine[k], slots[k], i);
    return buf;
  };
  std::vector<std::vector<float>> out(rounds.size());
  auto keep = [&](std::size_t k, const std::shared_ptr<lazy::Buffer>& b) {
    const auto* p = static_cast<const float*>(b->data());
    out[static_cast<std::size_t>(mine[k])].assign(p, p + kElements);
  };
  const std::size_t batched = style == Style::OneByOne ? 0 : style == Style::Batched ? mine.size() : std::min<std::size_t>(2, mine.size());
  std::vector<std::shared_ptr<lazy::Buffer>> results(mine.size());
  auto round = [&](std::size_t k) -> ReduceRound& { return *rounds[static_cast<std::size_t>(mine[k])].round; };
  for (std::size_t k = 0; k < batched; ++k) round(k).publish(slots[k], input(k));
  for (std::size_t k = 0; k < batched; ++k) results[k] = round(k).combine(slots[k], lazy::DType::Float32, kElements, dev);
  for (std::size_t k = 0; k < batched; ++k) round(k).release(slots[k]);
  for (std::size_t k = batched; k < mine.size(); ++k)
    results[k] = round(k).run(slots[k], input(k), lazy::DType::Float32, kElements, dev);
  for (std::size_t k = 0; k < mine.size(); ++k) keep(k, results[k]);
  return out;
}

}  // namespace

TEST(SpmdCollective, BatchedAndOneByOneMembersMeetInEveryMix) {
  const std::vector<std::vector<Style>> mixes = {{Style::OneByOne, Style::Batched, Style::Mixed},
                                                 {Style::Batched, Style::OneByOne, Style::Batched},
                                                 {Style::Mixed, Style::Mixed, Style::OneByOne},
                                                 {Style::Batched, Style::Batched, Style::Batched}};
  for (int iteration = 0; iteration < 40; ++iteration) {
    const auto& mix = mixes[static_cast<std::size_t>(iteration) % mixes.size()];
    const auto rounds = make_rounds();
    std::vector<std::vector<std::vector<float>>> got(3);
    std::vector<std::thread> threads;
    for (int d = 0; d < 3; ++d)
      threads.emplace_back([&, d] { got[static_cast<std::size_t>(d)] = meet(d, rounds, mix[static_cast<std::size_t>(d)]); });
    for (auto& t : threads) t.join();
    for (int r = 0; r < static_cast<int>(rounds.size()); ++r) {
      for (int d : rounds[static_cast<std::size_t>(r)].devices) {
        const auto& v = got[static_cast<std::size_t>(d)][static_cast<std::size_t>(r)];
        ASSERT_EQ(v.size(), static_cast<std::size_t>(kElements)) << "round " << r << " device " << d;
        for (std::int64_t i = 0; i < kElements; ++i)
          ASSERT_EQ(v[static_cast<std::size_t>(i)], reference(rounds[static_cast<std::size_t>(r)], r, i))
              << "round " << r << " device " << d << " element " << i << " (iteration " << iteration << ")";
      }
    }
  }
}

// A test kernel on `device` giving `value` + i at element i, after sleeping `delay`, or
// throwing while `fail` is set. `after` (if any) only orders it after that node.
// A materialized value on `dev`: `value` + i at element i.
lazy::graph::NodePtr data_node(lazy::graph::Device& dev, float value) {
  auto buf = dev.pool().acquire(lazy::padded_bytes(kElements, sizeof(float)));
  auto* p = static_cast<float*>(buf->data());
  for (std::int64_t i = 0; i < kElements; ++i) p[i] = value + static_cast<float>(i);
  return std::make_shared<lazy::graph::DataNode>(lazy::DType::Float32, lazy::Shape{kElements}, &dev, buf);
}

class FlakyNode final : public lazy::graph::Node {
 public:
  FlakyNode(lazy::graph::Device& device, float value, std::shared_ptr<std::atomic<bool>> fail,
            std::chrono::milliseconds delay, lazy::graph::NodePtr after = nullptr)
      : Node(lazy::graph::NodeKind::Host, lazy::DType::Float32, lazy::Shape{kElements}, &device,
             after ? lazy::graph::NodeList{after} : lazy::graph::NodeList{}),
        value_(value),
        fail_(std::move(fail)),
        delay_(delay) {}
  std::string op_name() const override { return "flaky"; }

 protected:
  void compute(lazy::graph::ExecContext& ctx) override {
    std::this_thread::sleep_for(delay_);
    if (fail_->load()) throw lazy::Error("flaky kernel failed");
    auto buf = allocate_output(ctx, false);
    auto* p = static_cast<float*>(buf->data());
    for (std::int64_t i = 0; i < kElements; ++i) p[i] = value_ + static_cast<float>(i);
    set_buffer(std::move(buf));
  }

 private:
  float value_;
  std::shared_ptr<std::atomic<bool>> fail_;
  std::chrono::milliseconds delay_;
};

TEST(SpmdCollective, AMemberThatFailsBeforePublishingStopsItsPeers) {
  auto& reg = lazy::graph::DeviceRegistry::get();
  auto& d0 = reg.device(0);
  auto& d1 = reg.device(1);
  ReduceRound round(Combine::Sum, {&d0, &d1});
  auto buf = d0.pool().acquire(lazy::padded_bytes(kElements, sizeof(float)));
  std::memset(buf->data(), 0, static_cast<std::size_t>(kElements) * sizeof(float));
  round.publish(0, buf);
  // Device 1's step fails and never publishes: its node goes back to the trace (as
  // return_to_trace does it, abandoning the round).
  std::thread fail([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    round.abandon(1);
  });
  EXPECT_THROW((void)round.combine(0, lazy::DType::Float32, kElements, d0), lazy::CollectiveError);
  fail.join();
  round.release(0);  // nobody will read device 0's input: returns at once
}

TEST(SpmdCollective, MembersShareOneResultSummedInChunksInGroupOrder) {
  // Rounds of many chunks (and a partial last one) in three dtypes, one member arriving
  // late; whoever is there claims chunks. Every member gets the same buffer, holding, as
  // soon as its run() returns, what a scalar loop gives adding the inputs in slot order
  // (float sums whose order changes the bits: values of very different magnitudes), and an
  // empty round works too.
  auto& reg = lazy::graph::DeviceRegistry::get();
  std::vector<lazy::graph::Device*> devs = {&reg.device(0), &reg.device(1), &reg.device(2)};
  auto value = [](int slot, std::int64_t i) {
    const double scale[] = {1e8, 1.0, -1e8};
    return scale[slot] + 0.37 * static_cast<double>((i * 7919 + slot * 31) % 1000);
  };
  auto check = [&](lazy::DType dtype, Combine op, auto tag, std::int64_t chunks) {
    using T = decltype(tag);
    const std::int64_t numel = chunks == 0 ? 0 : chunks * lazy::spmd::detail::combine_chunk_elements(sizeof(T)) + 5;
    auto want = [&](std::int64_t i) {
      T acc = static_cast<T>(value(0, i));
      for (int slot = 1; slot < 3; ++slot) {
        const T v = static_cast<T>(value(slot, i));
        acc = op == Combine::Sum ? static_cast<T>(acc + v) : std::max(acc, v);
      }
      return acc;
    };
    auto round = std::make_shared<ReduceRound>(op, devs);
    std::vector<std::shared_ptr<lazy::Buffer>> results(3);
    std::vector<std::int64_t> first_wrong(3, -1);
    std::latch start(3);
    std::vector<std::thread> threads;
    for (int slot = 0; slot < 3; ++slot) {
      threads.emplace_back([&, slot] {
        start.arrive_and_wait();
        if (slot == 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        auto& dev = *devs[static_cast<std::size_t>(slot)];
        auto in = dev.pool().acquire(lazy::padded_bytes(numel, sizeof(T)));
        auto* p = static_cast<T*>(in->data());
        for (std::int64_t i = 0; i < numel; ++i) p[i] = static_cast<T>(value(slot, i));
        auto out = round->run(slot, std::move(in), dtype, numel, dev);
        // Read at once, while peers may still be finishing: run() returns a complete result.
        const auto* got = static_cast<const T*>(out->data());
        for (std::int64_t i = 0; i < numel; ++i)
          if (!(got[i] == want(i))) {
            first_wrong[static_cast<std::size_t>(slot)] = i;
            break;
          }
        results[static_cast<std::size_t>(slot)] = std::move(out);
      });
    }
    for (auto& t : threads) t.join();
    for (int slot = 0; slot < 3; ++slot)
      EXPECT_EQ(first_wrong[static_cast<std::size_t>(slot)], -1) << "slot " << slot << " of " << numel << " elements";
    ASSERT_TRUE(results[0]->shared()) << "a result other devices read is never donated";
    for (int slot = 1; slot < 3; ++slot)
      ASSERT_EQ(results[static_cast<std::size_t>(slot)].get(), results[0].get()) << "slot " << slot;
  };
  check(lazy::DType::Float32, Combine::Sum, float{}, 64);
  check(lazy::DType::Float64, Combine::Sum, double{}, 64);
  check(lazy::DType::Int32, Combine::Max, std::int32_t{}, 3);
  check(lazy::DType::Float32, Combine::Sum, float{}, 0);
}

TEST(SpmdCollective, AMemberThatFailsAfterPublishingLeavesItsPeersTheWholeSum) {
  // Device 1 publishes, then its step fails before it combines: device 0 sums every chunk,
  // and its release does not wait for device 1.
  auto& reg = lazy::graph::DeviceRegistry::get();
  auto& d0 = reg.device(0);
  auto& d1 = reg.device(1);
  const std::int64_t numel = 2 * lazy::spmd::detail::combine_chunk_elements(sizeof(float)) + 3;
  ReduceRound round(Combine::Sum, {&d0, &d1});
  for (int slot = 0; slot < 2; ++slot) {
    auto& dev = slot == 0 ? d0 : d1;
    auto buf = dev.pool().acquire(lazy::padded_bytes(numel, sizeof(float)));
    auto* p = static_cast<float*>(buf->data());
    for (std::int64_t i = 0; i < numel; ++i) p[i] = static_cast<float>(i % 97) + 0.5f * static_cast<float>(slot);
    round.publish(slot, std::move(buf));
  }
  round.abandon(1);  // device 1's step stopped after it published
  auto out = round.combine(0, lazy::DType::Float32, numel, d0);
  round.release(0);
  const auto* got = static_cast<const float*>(out->data());
  for (std::int64_t i = 0; i < numel; ++i)
    ASSERT_EQ(got[i], 2.0f * static_cast<float>(i % 97) + 0.5f) << "element " << i;
}

TEST(SpmdCollective, ARoundRunAgainAfterAPeersFailureWaitsForThatPeer) {
  // Device 1's step fails before it publishes; device 0's combine reports it, and its node
  // goes back to the trace too. The program catches the error and steps again: device 0
  // runs its member once more (publishing the same input again), device 1 arrives late.
  // Device 0 must wait for it and get the sum: not count its own input twice as the whole
  // group, nor fail again on the failure it already reported.
  auto& reg = lazy::graph::DeviceRegistry::get();
  auto& d0 = reg.device(0);
  auto& d1 = reg.device(1);
  ReduceRound round(Combine::Sum, {&d0, &d1});
  auto input = [&](lazy::graph::Device& dev, float scale) {
    auto buf = dev.pool().acquire(lazy::padded_bytes(kElements, sizeof(float)));
    auto* p = static_cast<float*>(buf->data());
    for (std::int64_t i = 0; i < kElements; ++i) p[i] = scale * static_cast<float>(i + 1);
    return buf;
  };
  auto in0 = input(d0, 1.0f);
  round.publish(0, in0);
  round.abandon(1);
  EXPECT_THROW((void)round.combine(0, lazy::DType::Float32, kElements, d0), lazy::CollectiveError);
  round.abandon(0);

  std::shared_ptr<lazy::Buffer> out1;
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    out1 = round.run(1, input(d1, 100.0f), lazy::DType::Float32, kElements, d1);
  });
  round.publish(0, in0);
  std::shared_ptr<lazy::Buffer> out0;
  EXPECT_NO_THROW(out0 = round.combine(0, lazy::DType::Float32, kElements, d0));
  round.release(0);
  late.join();
  ASSERT_TRUE(out0 && out1);
  EXPECT_EQ(out0.get(), out1.get());
  const auto* got = static_cast<const float*>(out0->data());
  for (std::int64_t i = 0; i < kElements; ++i) ASSERT_EQ(got[i], 101.0f * static_cast<float>(i + 1)) << "element " << i;
}

TEST(SpmdCollective, AStepRunAgainAfterAFailureAheadOfItsAllReducesComputesThem) {
  // Device 1's step fails before its two all-reduces (a kernel ahead of them throws): the
  // sync reports it at once, and device 0 does not wait out the collective timeout. Run
  // again with the kernel fixed, the step computes both sums, although device 1 now
  // reaches the second 20 ms after device 0 (a kernel between them): a failure of the
  // first attempt does not count against the second.
  auto& reg = lazy::graph::DeviceRegistry::get();
  auto& d0 = reg.device(0);
  auto& d1 = reg.device(1);
  auto fail = std::make_shared<std::atomic<bool>>(true);
  auto never = std::make_shared<std::atomic<bool>>(false);
  auto data = data_node;
  using namespace std::chrono_literals;
  auto flaky = lazy::graph::submit_unpartitioned(std::make_shared<FlakyNode>(d1, 10.0f, fail, 0ms));
  const auto first = spmd::all_reduce({data(d0, 1.0f), flaky}, Combine::Sum);
  auto slow = lazy::graph::submit_unpartitioned(std::make_shared<FlakyNode>(d1, 20.0f, never, 20ms, first[1]));
  const auto second = spmd::all_reduce({data(d0, 2.0f), slow}, Combine::Sum);
  lazy::graph::NodeList results = {first[0], first[1], second[0], second[1]};
  for (const auto& n : results) n->add_handle();  // as tensors holding them: mark_step computes them

  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(
      {
        lazy::mark_step();
        lazy::wait_device_ops();
      },
      lazy::Error);
  // Each device stored its own error (device 1 the kernel's, device 0 a CollectiveError);
  // a sync reports one at a time.
  for (int i = 0; i < 2; ++i) {
    try {
      lazy::wait_device_ops();
    } catch (const lazy::Error&) {
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "device 0 waited for the timeout";
  for (const auto& n : results) EXPECT_FALSE(n->materialized());

  fail->store(false);
  lazy::mark_step();
  EXPECT_NO_THROW(lazy::wait_device_ops());
  for (const auto& n : results) n->drop_handle();
  for (std::size_t r = 0; r < results.size(); ++r) {
    ASSERT_TRUE(results[r]->materialized()) << "result " << r;
    const float base = r < 2 ? 11.0f : 22.0f;
    const auto* got = results[r]->data<float>();
    for (std::int64_t i = 0; i < kElements; ++i)
      ASSERT_EQ(got[i], base + 2.0f * static_cast<float>(i)) << "result " << r << " element " << i;
  }
}

TEST(SpmdCollective, ADeviceThatRefusesItsStepLeavesNoOtherUnstepped) {
  // Device 1 holds an earlier step's error, so it refuses its next step. An all-reduce over
  // devices 0 and 2 still completes: stepping every device stops at none (it used to stop
  // at device 1, and device 0 waited out the collective timeout for device 2).
  auto& reg = lazy::graph::DeviceRegistry::get();
  auto& d0 = reg.device(0);
  auto& d1 = reg.device(1);
  auto& d2 = reg.device(2);
  d1.store_error(std::make_exception_ptr(lazy::Error("an earlier step of device 1 failed")));
  const auto sums = spmd::all_reduce({data_node(d0, 1.0f), data_node(d2, 3.0f)}, Combine::Sum);
  for (const auto& n : sums) n->add_handle();
  // Something for device 1 to step (a device with nothing pending has no step to refuse).
  auto other = lazy::graph::submit_unpartitioned(std::make_shared<FlakyNode>(
      d1, 5.0f, std::make_shared<std::atomic<bool>>(false), std::chrono::milliseconds(0)));
  other->add_handle();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(lazy::graph::step_all_devices(), lazy::Error);  // device 1's, reported once
  EXPECT_NO_THROW(lazy::wait_device_ops());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << "a device waited for the timeout";
  for (const auto& n : sums) n->drop_handle();
  EXPECT_FALSE(other->materialized()) << "device 1 refused its step";
  other->drop_handle();
  for (std::size_t r = 0; r < sums.size(); ++r) {
    ASSERT_TRUE(sums[r]->materialized()) << "member " << r;
    const auto* got = sums[r]->data<float>();
    for (std::int64_t i = 0; i < kElements; ++i)
      ASSERT_EQ(got[i], 4.0f + 2.0f * static_cast<float>(i)) << "member " << r << " element " << i;
  }
}

TEST(SpmdCollective, ADeviceStoppingWithAStepQueuedReleasesItsPeers) {
  // At process exit a device drops the steps still queued on its executor. A peer already
  // waiting in an all-reduce with one of them ends with an error at once, instead of
  // waiting out the collective timeout (and holding up the exit, which joins its executor).
  using namespace std::chrono_literals;
  auto d0 = std::make_unique<lazy::graph::Device>(90, 1);
  auto d1 = std::make_unique<lazy::graph::Device>(91, 1);
  for (auto* d : {d0.get(), d1.get()}) {
    d->async() = true;
    d->queue_every_step() = true;
  }
  const auto sums = spmd::all_reduce({data_node(*d0, 1.0f), data_node(*d1, 2.0f)}, Combine::Sum);
  for (const auto& n : sums) n->add_handle();
  d0->enqueue([] { std::this_thread::sleep_for(200ms); });  // busy: d0's step stays queued
  lazy::graph::run_step(*d1, lazy::graph::collect_step(*d1), /*wait_previous=*/false);
  lazy::graph::run_step(*d0, lazy::graph::collect_step(*d0), /*wait_previous=*/false);
  std::this_thread::sleep_for(20ms);  // d1's executor waits in the all-reduce
  const auto start = std::chrono::steady_clock::now();
  d0.reset();  // drops d0's step, joins its executor
  d1->wait_idle();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "d1 waited for the timeout";
  try {
    d1->rethrow_stored_error();
    ADD_FAILURE() << "d1's step did not fail";
  } catch (const lazy::CollectiveTimeout&) {
    ADD_FAILURE() << "d1 waited out the collective timeout";
  } catch (const lazy::CollectiveError& e) {
    EXPECT_NE(std::string(e.what()).find("CPU:90"), std::string::npos) << e.what();
  }
  for (const auto& n : sums) n->drop_handle();
  EXPECT_FALSE(sums[1]->materialized());
}

TEST(SpmdCollective, ADataParallelStepMeetsItsPeersOnce) {
  const spmd::Mesh mesh({0, 1, 2, 3}, {4}, {"data"});
  auto w1 = lazy_tests::random_tensor({6, 5}, 71), w2 = lazy_tests::random_tensor({3, 6}, 72);
  auto b1 = lazy_tests::random_tensor({6}, 73);
  auto x = lazy_tests::random_tensor({8, 5}, 74);
  auto loss_of = [](const lazy::Tensor<double>& x, const lazy::Tensor<double>& w1, const lazy::Tensor<double>& b1,
                    const lazy::Tensor<double>& w2) {
    auto h = lazy::Tensor<double>(lazy::relu(lazy::linear(x, w1, b1)));
    return lazy::sum(lazy::Tensor<double>(lazy::linear(h, w2)));
  };
  auto rw1 = w1.detach().requires_grad_(), rb1 = b1.detach().requires_grad_(), rw2 = w2.detach().requires_grad_();
  auto ref = loss_of(x, rw1, rb1, rw2);
  ref.backward();
  lazy::mark_step();

  for (auto* p : {&w1, &b1, &w2}) spmd::mark_sharding(*p, mesh, {}).requires_grad_();
  spmd::mark_sharding(x, mesh, {"data"});
  const auto reduces = lazy_tests::counter_value("SpmdAllReduces");
  const auto batches = lazy_tests::counter_value("CollectiveBatches");
  auto loss = loss_of(x, w1, b1, w2);
  loss.backward();
  lazy::mark_step();
  lazy::wait_device_ops();
  // The loss and the three gradients are all-reduced, and nothing in the step reads any of
  // them: all four meet in one batch per device.
  EXPECT_EQ(lazy_tests::counter_value("SpmdAllReduces") - reduces, 4);
  EXPECT_EQ(lazy_tests::counter_value("CollectiveBatches") - batches, 4) << "one batch per device";
  lazy_tests::expect_close_rel(loss.to_vector(), ref.to_vector(), "loss");
  lazy_tests::expect_close_rel(w1.grad().to_vector(), rw1.grad().to_vector(), "w1 grad");
  lazy_tests::expect_close_rel(b1.grad().to_vector(), rb1.grad().to_vector(), "b1 grad");
  lazy_tests::expect_close_rel(w2.grad().to_vector(), rw2.grad().to_vector(), "w2 grad");
}

TEST(SpmdCollective, AnAllReduceThatIsReadBeforeTheNextRunsAlone) {
  // Megatron's pair twice in a row: each all-reduce's sum feeds the next pair, so no two of
  // them can meet together.
  const spmd::Mesh mesh({0, 1, 2, 3}, {1, 4}, {"data", "model"});
  auto x = lazy_tests::random_tensor({4, 8}, 81);
  std::vector<lazy::Tensor<double>> ws;
  for (unsigned i = 0; i < 4; ++i) ws.push_back(lazy_tests::random_tensor({8, 8}, 82 + i));
  auto forward = [&](const std::vector<lazy::Tensor<double>>& w) {
    lazy::Tensor<double> h = x;
    for (std::size_t i = 0; i < w.size(); i += 2) {
      auto a = lazy::Tensor<double>(lazy::relu(lazy::linear(h, w[i])));
      h = lazy::Tensor<double>(lazy::relu(lazy::linear(a, w[i + 1])));
    }
    return h;
  };
  std::vector<lazy::Tensor<double>> ref_ws;
  for (auto& w : ws) ref_ws.push_back(w.detach());
  auto ref = forward(ref_ws);
  lazy::mark_step();
  for (std::size_t i = 0; i < ws.size(); ++i)
    spmd::mark_sharding(ws[i], mesh, i % 2 == 0 ? spmd::PartitionSpec{"model", std::nullopt} : spmd::PartitionSpec{std::nullopt, "model"});
  const auto reduces = lazy_tests::counter_value("SpmdAllReduces");
  const auto batches = lazy_tests::counter_value("CollectiveBatches");
  auto got = forward(ws);
  lazy::mark_step();
  lazy::wait_device_ops();
  EXPECT_EQ(lazy_tests::counter_value("SpmdAllReduces") - reduces, 2) << "one per column-row pair";
  EXPECT_EQ(lazy_tests::counter_value("CollectiveBatches") - batches, 0);
  lazy_tests::expect_close_rel(got.to_vector(), ref.to_vector(), "output");
}

TEST(SpmdCollective, AnAllReduceOfAnAllReducesResultWaitsForIt) {
  // Two all-reduces, the second of the first's results: the planner must not put them in
  // one batch (the second would publish a value not computed yet).
  auto& reg = lazy::graph::DeviceRegistry::get();
  lazy::graph::NodeList pieces;
  std::vector<double> want(kElements, 0.0);
  for (int d = 0; d < 4; ++d) {
    auto& dev = reg.device(d);
    auto buf = dev.pool().acquire(lazy::padded_bytes(kElements, sizeof(double)));
    auto* p = static_cast<double*>(buf->data());
    for (std::int64_t i = 0; i < kElements; ++i) {
      p[i] = static_cast<double>(d + 1) * 0.5 + static_cast<double>(i);
      want[static_cast<std::size_t>(i)] += 4 * p[i];  // summed, then the 4 equal sums summed
    }
    pieces.push_back(std::make_shared<lazy::graph::DataNode>(lazy::DType::Float64, lazy::Shape{kElements}, &dev, buf));
  }
  const auto batches = lazy_tests::counter_value("CollectiveBatches");
  const auto twice = spmd::all_reduce(spmd::all_reduce(pieces, Combine::Sum), Combine::Sum);
  for (const auto& n : twice) n->add_handle();  // as a tensor holding it: mark_step computes it
  lazy::mark_step();
  lazy::wait_device_ops();
  for (const auto& n : twice) n->drop_handle();
  EXPECT_EQ(lazy_tests::counter_value("CollectiveBatches") - batches, 0);
  for (int d = 0; d < 4; ++d) {
    ASSERT_TRUE(twice[static_cast<std::size_t>(d)]->materialized()) << "device " << d;
    const auto* got = twice[static_cast<std::size_t>(d)]->data<double>();
    for (std::int64_t i = 0; i < kElements; ++i)
      EXPECT_EQ(got[i], want[static_cast<std::size_t>(i)]) << "device " << d << " element " << i;
  }
}
