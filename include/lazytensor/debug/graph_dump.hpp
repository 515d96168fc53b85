#pragma once
// The pending graph behind tensors, as text or Graphviz DOT (the analogue of
// torch_xla's get_stablehlo / graph dumps), with the fusion the planner would apply if
// mark_step ran now: cross-statement element-wise groups (chunk-interleaved; a member kept
// only in chunk scratch is marked) and GEMMs run in row blocks by their epilogue.

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/graph/executor.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy::debug {

/// A tensor handle (anything with node()).
template <class T>
concept HasNode = requires(const T& t) { t.node(); };

namespace detail {
template <class... Ts>
graph::NodeList roots_of(const Ts&... ts) {
  return {ts.node()...};
}

/// How the planner would run the pending nodes: the fused group of each node (-1: alone)
/// and whether its value would only live in chunk scratch.
struct Fusion {
  std::unordered_map<const graph::Node*, int> group;
  std::unordered_map<const graph::Node*, bool> scratch_only;
};

Fusion plan_fusion(const graph::NodeList& order);

graph::NodeList with_inputs(const graph::NodeList& roots, Fusion* fusion);

std::string type_str(const graph::Node& n);
}  // namespace detail

/// The graph that computes `tensors`, one node per line in execution order:
/// `%3 = float32(4, 4) fused(add(%0, %1)) <- %1, %2`. Materialized inputs show as data.
/// Fusion shows at the end of a line: `{group 0}` for members of a chunk-interleaved group
/// (`{group 0, scratch}` when the value is never written whole), `{in row blocks of %5}`
/// for a GEMM that its epilogue %5 runs block by block.
std::string graph_text(const graph::NodeList& roots);

/// The graph as text for tensors given directly: graph_text(y, z).
template <class... Ts>
std::string graph_text(const Ts&... tensors)
  requires(sizeof...(Ts) > 0 && (HasNode<Ts> && ...))
{
  return graph_text(detail::roots_of(tensors...));
}

/// The graph in Graphviz DOT; render with `dot -Tpng`. Fused groups are clusters
/// ("fused group N"); scratch-only members are dotted; a GEMM run in row blocks by its
/// epilogue is linked to it by a bold edge.
std::string graph_dot(const graph::NodeList& roots);

/// DOT for tensors given directly.
template <class... Ts>
std::string graph_dot(const Ts&... tensors)
  requires(sizeof...(Ts) > 0 && (HasNode<Ts> && ...))
{
  return graph_dot(detail::roots_of(tensors...));
}

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE Fusion plan_fusion(const graph::NodeList& order) {
  Fusion f;
  if (order.empty()) return f;
  graph::prepare(order);  // decisions redone by the real step's planning
  const std::uint64_t epoch = graph::detail::number_nodes(order);
  std::vector<std::uint8_t> outside;
  std::vector<std::uint64_t> sig;
  graph::detail::plan_signature(order, epoch, outside, sig);
  auto plan = graph::detail::build_plan(order, epoch, outside);
  int g = 0;
  for (const auto& st : plan->steps) {
    if (st.kind != graph::PlanStep::Kind::Group) continue;
    for (std::size_t j = 0; j < st.members.size(); ++j) {
      const graph::Node* n = order[static_cast<std::size_t>(st.members[j])].get();
      f.group[n] = g;
      f.scratch_only[n] = !st.whole[j];
    }
    ++g;
  }
  return f;
}

LAZYTENSOR_INLINE graph::NodeList with_inputs(const graph::NodeList& roots, Fusion* fusion) {
  // Steps in flight finish first: a dump looks at values, not at a graph being executed.
  for (const auto& r : roots)
    if (r) r->device()->wait_idle();
  // Pending nodes in execution order, plus the materialized values they read.
  graph::NodeList order = graph::topological_order(roots);
  if (fusion) *fusion = plan_fusion(order);
  graph::NodeList all;
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

LAZYTENSOR_INLINE std::string type_str(const graph::Node& n) { return dtype_name(n.dtype()) + n.shape().str(); }

}  // namespace detail

LAZYTENSOR_INLINE std::string graph_text(const graph::NodeList& roots) {
  detail::Fusion fusion;
  auto nodes = detail::with_inputs(roots, &fusion);
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
    if (auto g = fusion.group.find(n.get()); g != fusion.group.end())
      os << "  {group " << g->second << (fusion.scratch_only[n.get()] ? ", scratch}" : "}");
    if (n->deferred())
      for (const auto& c : nodes)
        if (!c->materialized() && std::find(c->inputs().begin(), c->inputs().end(), n) != c->inputs().end())
          os << "  {in row blocks of %" << id[c.get()] << "}";
    for (const auto& r : roots)
      if (r == n) {
        os << "  (output)";
        break;
      }
    os << "\n";
  }
  return os.str();
}

LAZYTENSOR_INLINE std::string graph_dot(const graph::NodeList& roots) {
  detail::Fusion fusion;
  auto nodes = detail::with_inputs(roots, &fusion);
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
    auto g = fusion.group.find(n.get());
    if (g != fusion.group.end()) os << "  subgraph cluster_" << g->second << " { label=\"fused group " << g->second << "\";";
    os << "  n" << id[n.get()] << " [label=\"%" << id[n.get()] << " " << esc << "\\n" << detail::type_str(*n) << "\""
       << (n->materialized() ? ", style=dashed" : "") << (g != fusion.group.end() && fusion.scratch_only[n.get()] ? ", style=dotted" : "")
       << (out ? ", peripheries=2" : "") << "];" << (g != fusion.group.end() ? " }" : "") << "\n";
  }
  for (const auto& n : nodes)
    if (!n->materialized())
      for (const auto& in : n->inputs())
        os << "  n" << id[in.get()] << " -> n" << id[n.get()] << (in->deferred() ? " [style=bold]" : "") << ";\n";
  os << "}\n";
  return os.str();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::debug
