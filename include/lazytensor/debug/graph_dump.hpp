#pragma once
// The pending graph behind tensors, as text or Graphviz DOT (the analogue of
// torch_xla's get_stablehlo / graph dumps).

#include <algorithm>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <lazytensor/graph/executor.hpp>
#include <lazytensor/tensor.hpp>

namespace lazy::debug {

/// A tensor handle (anything with node()).
template <class T>
concept HasNode = requires(const T& t) { t.node(); };

namespace detail {
template <class... Ts>
std::vector<graph::NodePtr> roots_of(const Ts&... ts) {
  return {ts.node()...};
}

inline std::vector<graph::NodePtr> with_inputs(const std::vector<graph::NodePtr>& roots) {
  // Pending nodes in execution order, plus the materialized values they read.
  std::vector<graph::NodePtr> order = graph::topological_order(roots);
  std::vector<graph::NodePtr> all;
  std::unordered_map<const graph::Node*, bool> seen;
  for (const auto& n : order)
    for (const auto& in : n->inputs())
      if (in->materialized() && !seen[in.get()]) {
        seen[in.get()] = true;
        all.push_back(in);
      }
  for (const auto& r : roots)
    if (r->materialized() && !seen[r.get()]) {
      seen[r.get()] = true;
      all.push_back(r);
    }
  all.insert(all.end(), order.begin(), order.end());
  return all;
}

inline std::string type_str(const graph::Node& n) { return dtype_name(n.dtype()) + n.shape().str(); }
}  // namespace detail

/// The graph that computes `tensors`, one node per line in execution order:
/// `%3 = float32(4, 4) fused(add(%0, %1)) <- %1, %2`. Materialized inputs show as data.
inline std::string graph_text(const std::vector<graph::NodePtr>& roots) {
  auto nodes = detail::with_inputs(roots);
  std::unordered_map<const graph::Node*, int> id;
  for (const auto& n : nodes) id.emplace(n.get(), static_cast<int>(id.size()));
  std::ostringstream os;
  for (const auto& n : nodes) {
    os << "%" << id[n.get()] << " = " << detail::type_str(*n) << " ";
    if (n->materialized()) {
      os << "data";
    } else {
      os << n->op_name() << "[" << n->describe() << "]";
      if (!n->inputs().empty()) {
        os << " <-";
        for (const auto& in : n->inputs()) os << " %" << id[in.get()];
      }
    }
    for (const auto& r : roots)
      if (r == n) {
        os << "  (output)";
        break;
      }
    os << "\n";
  }
  return os.str();
}

/// The graph as text for tensors given directly: graph_text(y, z).
template <class... Ts>
std::string graph_text(const Ts&... tensors)
  requires(sizeof...(Ts) > 0 && (HasNode<Ts> && ...))
{
  return graph_text(detail::roots_of(tensors...));
}

/// The graph in Graphviz DOT; render with `dot -Tpng`.
inline std::string graph_dot(const std::vector<graph::NodePtr>& roots) {
  auto nodes = detail::with_inputs(roots);
  std::unordered_map<const graph::Node*, int> id;
  for (const auto& n : nodes) id.emplace(n.get(), static_cast<int>(id.size()));
  std::ostringstream os;
  os << "digraph lazytensor {\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\"];\n";
  for (const auto& n : nodes) {
    std::string label = n->materialized() ? "data" : n->op_name() + "\\n" + n->describe();
    std::string esc;
    for (char c : label) {
      if (c == '"') esc += "\\\"";
      else esc += c;
    }
    const bool out = std::find(roots.begin(), roots.end(), n) != roots.end();
    os << "  n" << id[n.get()] << " [label=\"%" << id[n.get()] << " " << esc << "\\n" << detail::type_str(*n) << "\""
       << (n->materialized() ? ", style=dashed" : "") << (out ? ", peripheries=2" : "") << "];\n";
  }
  for (const auto& n : nodes)
    if (!n->materialized())
      for (const auto& in : n->inputs()) os << "  n" << id[in.get()] << " -> n" << id[n.get()] << ";\n";
  os << "}\n";
  return os.str();
}

/// DOT for tensors given directly.
template <class... Ts>
std::string graph_dot(const Ts&... tensors)
  requires(sizeof...(Ts) > 0 && (HasNode<Ts> && ...))
{
  return graph_dot(detail::roots_of(tensors...));
}

}  // namespace lazy::debug
