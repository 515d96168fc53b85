# cmake -DNM=<nm> -DOBJECTS=<object files> -P check_compiled_symbols.cmake
#
# Fails when a program built against lazytensor::compiled (the float-only one; the ops one:
# products, convolution, pooling, softmax) defines one of the library's own per-dtype
# templates: the compiled runtime instantiates those once, and the headers declare them
# `extern template` (LAZYTENSOR_<NAME>_INSTANCES, core/config.hpp). A
# template that slips out of its header's list, or a member template moved back into its
# class (inline, so GCC instantiates it to inline it), shows up here. The program's own
# statements (their kernels, backward functions and nodes) are expected and allowed.
set(library_templates
  "lazy::autograd::(add_nodes_of|sum_to_shape_of|cast_node_to|full_node_of|register_grad_dtype|register_grad_cast)<"
  "lazy::detail::(view_of|permute_impl|make_random)<"
  # (Over a tensor only: a sum of an expression is the program's own statement.)
  "lazy::detail::(record_sum|record_extreme)<[^<>]*, lazy::Tensor<"
  "lazy::detail::reduction_node<[^<>]*, lazy::Tensor<"
  "lazy::graph::detail::eigen_gemm_(rows|add_nt)<"
  "lazy::nn::[A-Za-z0-9_]+Impl::forward"
  "lazy::nn::([A-Za-z0-9_]+)Impl::[A-Za-z0-9_]+Impl<"
  "lazy::nn::SequentialImpl::push_back<"
  "lazy::optim::[A-Za-z0-9_<>:, ]*::validate"
  "lazy::nn::functional::"
  "lazy::nn::init::"
  "lazy::optim::[A-Za-z0-9_<>:, ]*::step"
  "lazy::(detail::)?(matmul|gemm|im2col|col2im|conv2d_impl|pool2d|softmax_rows)<"
  "lazy::graph::(GemmNode|Im2colNode|Col2imNode|ConvWeightGradNode|Pool2dNode|Pool2dBackwardNode|SoftmaxNode)<"
  "lazy::detail::[A-Za-z0-9_]*Gemm[A-Za-z0-9_]*(<[^()]*>)?::")
include("${CMAKE_CURRENT_LIST_DIR}/symbols.cmake")
lean_read_symbols("${OBJECTS}" entries count)
set(bad "")
foreach(entry IN LISTS entries)
  # Functions only (code: T, t, W, w).
  if(NOT entry MATCHES "^[TtWw] ")
    continue()
  endif()
  string(REGEX REPLACE "^[A-Za-z] " "" name "${entry}")
  foreach(pattern IN LISTS library_templates)
    if(name MATCHES "${pattern}")
      list(APPEND bad "${name}")
      break()
    endif()
  endforeach()
endforeach()
lean_report(${count} 50 bad "with lazytensor::compiled, the program still instantiates the library's own templates")
message(STATUS "program against the compiled runtime: ${count} symbols, none of the library's per-dtype templates")
