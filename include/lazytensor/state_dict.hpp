#pragma once
// StateDict: named tensors in insertion order, plus string metadata. What Module::state_dict,
// Optimizer::state_dict and lazy::io::save/load exchange (libtorch's OrderedDict of tensors;
// the metadata maps to safetensors' "__metadata__").

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy {

/// Ordered name -> tensor map with unique names, plus free-form string metadata.
class StateDict {
 public:
  using Item = std::pair<std::string, AnyTensor>;

  /// Adds `name`; Error when the name is already present.
  void insert(const std::string& name, AnyTensor t);
  /// Adds or replaces `name`.
  void insert_or_assign(const std::string& name, AnyTensor t);
  /// True when `name` is present.
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  /// The tensor stored under `name`, or nullptr.
  const AnyTensor* find(const std::string& name) const;
  /// The tensor stored under `name`; Error naming the key when it is missing.
  const AnyTensor& at(const std::string& name) const;
  /// Every (name, tensor) pair in insertion order.
  const std::vector<Item>& items() const { return items_; }
  std::vector<Item>::const_iterator begin() const { return items_.begin(); }
  std::vector<Item>::const_iterator end() const { return items_.end(); }
  std::size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  /// The keys in insertion order.
  std::vector<std::string> keys() const;

  /// Free-form string metadata (hyper-parameters, format versions, ...).
  std::map<std::string, std::string>& metadata() { return metadata_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// The safetensors dtype to write a tensor as, by name, when it is not its own dtype's:
  /// io::load records here each tensor it widened (an F16 tensor loaded as float maps to
  /// "F16", a U8 one loaded as int32 to "U8"), so saving the dict writes the file's dtypes
  /// back. Set an entry to store a float tensor as "F16", or an int32 one as "U8", "I8",
  /// "I16" or "U16" (int64 as "U32"); save raises FormatError for values that do not fit.
  std::map<std::string, std::string>& stored_dtypes() { return stored_dtypes_; }
  const std::map<std::string, std::string>& stored_dtypes() const { return stored_dtypes_; }

 private:
  std::vector<Item> items_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, std::string> stored_dtypes_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void StateDict::insert(const std::string& name, AnyTensor t) {
  if (index_.count(name)) throw Error("StateDict: duplicate key '" + name + "'");
  index_.emplace(name, items_.size());
  items_.emplace_back(name, std::move(t));
}

LAZYTENSOR_INLINE void StateDict::insert_or_assign(const std::string& name, AnyTensor t) {
  if (auto it = index_.find(name); it != index_.end()) items_[it->second].second = std::move(t);
  else insert(name, std::move(t));
}

LAZYTENSOR_INLINE const AnyTensor* StateDict::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

LAZYTENSOR_INLINE const AnyTensor& StateDict::at(const std::string& name) const {
  if (const AnyTensor* t = find(name)) return *t;
  throw Error("StateDict: missing key '" + name + "'");
}

LAZYTENSOR_INLINE std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> k;
  for (const auto& [n, t] : items_) k.push_back(n);
  return k;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy
