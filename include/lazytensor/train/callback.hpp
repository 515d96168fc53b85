#pragma once
// train::Callback, Lightning's: code that the Trainer calls at fixed points of its loops
// (the hooks below, with Lightning's names and order), and whose state a checkpoint keeps.
//
// With replicas every replica runs the hooks of its own copy (clone()), so a callback may
// call the strategy's collectives (ModelCheckpoint saves, EarlyStopping agrees on a stop):
// the user's object is global rank zero's copy, which holds the state after fit. A
// callback that does not override clone() is shared, and the Trainer calls its hooks on
// global rank zero only.

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>

namespace lazy::train {

class Trainer;
class LightningModuleBase;

/// Base of the Trainer's callbacks.
class Callback {
 public:
  virtual ~Callback() = default;

  /// This replica's copy (nullptr: shared, hooks on global rank zero only).
  virtual std::shared_ptr<Callback> clone() const { return nullptr; }
  /// Key of the callback's state in a checkpoint (Lightning's state_key): unique among a
  /// Trainer's callbacks.
  virtual std::string state_key() const { return "Callback"; }
  /// Whether it acts on monitored values (ModelCheckpoint, EarlyStopping): its
  /// on_train_epoch_end then runs after the module's, so that it sees what the module logs
  /// there (Lightning's order).
  virtual bool monitors() const { return false; }
  /// The callback's state, saved in every checkpoint's metadata. The Trainer also calls it
  /// when it is constructed and before each checkpoint, to find the stateful callbacks
  /// (those with a non-empty state) and refuse two under one state_key; so it must be
  /// callable before the fit starts.
  virtual std::map<std::string, std::string> state_dict() const { return {}; }
  /// Restores what state_dict() returned (resuming a fit).
  virtual void load_state_dict(const std::map<std::string, std::string>& state) { (void)state; }

  virtual void on_fit_start(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_fit_end(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_sanity_check_start(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_sanity_check_end(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_train_start(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_train_end(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_train_epoch_start(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_train_epoch_end(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_train_batch_start(Trainer& trainer, LightningModuleBase& module, std::int64_t batch_idx) {
    (void)trainer, (void)module, (void)batch_idx;
  }
  /// After the batch's step (and, every accumulate_grad_batches batches, the optimizer
  /// step).
  virtual void on_train_batch_end(Trainer& trainer, LightningModuleBase& module, std::int64_t batch_idx) {
    (void)trainer, (void)module, (void)batch_idx;
  }
  virtual void on_validation_start(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_validation_epoch_start(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_validation_batch_end(Trainer& trainer, LightningModuleBase& module, std::int64_t batch_idx) {
    (void)trainer, (void)module, (void)batch_idx;
  }
  /// After the validation epoch's values are in trainer.callback_metrics().
  virtual void on_validation_epoch_end(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_validation_end(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_test_start(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_test_epoch_end(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_test_end(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_predict_start(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  virtual void on_predict_end(Trainer& trainer, LightningModuleBase& module) { (void)trainer, (void)module; }
  /// When the run fails with `e` on this replica (before the error leaves fit).
  virtual void on_exception(Trainer& trainer, LightningModuleBase& module, const std::exception& e) {
    (void)trainer, (void)module, (void)e;
  }
};

}  // namespace lazy::train
