# cmake -DNM=<nm> -DOBJECTS=<object files> -P check_symbols.cmake
#
# Fails when the float-only program's objects define a symbol whose template arguments name
# bfloat16 or double: a kernel, node or backward compiled for a dtype the program never uses;
# or backward code for an expression without a float tensor leaf; or a vtable of a module the
# program never uses.
# Function parameters of type double (a learning rate, a cost) are fine; template arguments
# are what select kernels, so only the part of each demangled name before its parameter list
# is searched.
include("${CMAKE_CURRENT_LIST_DIR}/symbols.cmake")
lean_read_symbols("${OBJECTS}" entries count)
set(bad "")
foreach(entry IN LISTS entries)
  string(REGEX REPLACE "^[A-Za-z] " "" name "${entry}")
  # Expression builders take a scalar operand as written (`x * 0.5`) and turn it into the
  # tensor's dtype: a builder with a double operand is no double kernel. Without inlining
  # (the sanitizer builds' -O1) they are symbols of their own.
  if(name MATCHES "^(auto )?lazy::(expr::make|operator)")
    continue()
  endif()
  if(name MATCHES "lazy::" AND name MATCHES "bfloat16|[<,] ?double ?[,>]")
    list(APPEND bad "${name}")
  endif()
  # Backward code exists only for expressions that read a floating tensor (only those can
  # require grad), here a float one: a gradient kernel without a float leaf is dead code.
  # (`name` is cut at its parameter list; no op type takes a value template argument, which
  # GCC would print as "(Type)1" and cut there.)
  if(name MATCHES "KGrad<|ElementwiseGradFn<" AND NOT name MATCHES "KLeaf<float>")
    list(APPEND bad "${name}")
  endif()
  # The program uses a Linear layer and SGD, nothing of train, io or data, no collective and
  # no other layer: any symbol of train, io or data, or a vtable of another module's class,
  # usually means a class whose key function is inline, so that every TU compiles its vtable
  # and every virtual function (core/config.hpp).
  if(name MATCHES "(^|[ <,])lazy::(train|io|data)::" OR
     name MATCHES "^vtable for lazy::(dist|spmd)::" OR
     (name MATCHES "^vtable for lazy::nn::" AND NOT name MATCHES "^vtable for lazy::nn::(Module|LinearImpl)$") OR
     name MATCHES "^vtable for lazy::graph::(CatNode|SliceNode|PoolNode|RoundToBFloat16Node)$")
    list(APPEND bad "${name}")
  endif()
endforeach()
lean_report(${count} 100 bad "the float-only program defines symbols for other dtypes, dead backward code or unused modules")
message(STATUS "float-only program: ${count} symbols, none for double or bfloat16, no dead backward, no unused module")
