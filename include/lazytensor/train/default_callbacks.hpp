#pragma once
// What a Trainer adds on its own, as Lightning's does: a ModelCheckpoint (saving each
// epoch's end) unless checkpointing is off or one is given, a ProgressBar unless it is off
// or one is given, and a CSVLogger under default_root_dir when `logger` is true.

#include <memory>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/train/csv_logger.hpp>
#include <lazytensor/train/model_checkpoint.hpp>
#include <lazytensor/train/progress_bar.hpp>
#include <lazytensor/train/trainer.hpp>

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::train::detail {

template <class>
void add_default_callbacks(std::vector<std::shared_ptr<Callback>>& callbacks,
                                             const TrainerOptions& options, bool checkpointing, bool progress_bar) {
  (void)options;
  bool has_checkpoint = false, has_bar = false;
  for (const auto& c : callbacks) {
    has_checkpoint = has_checkpoint || dynamic_cast<const ModelCheckpoint*>(c.get());
    has_bar = has_bar || dynamic_cast<const ProgressBar*>(c.get());
  }
  if (checkpointing && !has_checkpoint) callbacks.push_back(std::make_shared<ModelCheckpoint>());
  if (progress_bar && !has_bar) callbacks.push_back(std::make_shared<ProgressBar>());
}

template <class>
std::shared_ptr<Logger> make_default_logger(const TrainerOptions& options) {
  return std::make_shared<CSVLogger>(options.default_root_dir);
}

}  // namespace lazy::train::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

// The Trainer's constructor and what it builds, defined once by lazytensor::compiled
// (src/compiled.cpp).
#define LAZYTENSOR_TRAIN_TRAINER_INSTANCES(P)                                                        \
  P template lazy::train::Trainer::Trainer(lazy::train::TrainerOptions);                             \
  P template std::shared_ptr<lazy::train::Strategy> lazy::train::detail::make_strategy<void>(        \
      const lazy::train::TrainerOptions&);                                                           \
  P template std::shared_ptr<lazy::train::Logger> lazy::train::detail::make_default_logger<void>(    \
      const lazy::train::TrainerOptions&);                                                           \
  P template void lazy::train::detail::add_default_callbacks<void>(                                  \
      std::vector<std::shared_ptr<lazy::train::Callback>>&, const lazy::train::TrainerOptions&, bool, bool);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_TRAINER_INSTANCES(extern)
#endif
