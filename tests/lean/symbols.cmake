# lean_read_symbols(<objects> <names-var> <count-var>): the symbols the objects define (nm -C
# --defined-only, with ${NM}), each as "<type> <name>" with its name cut at the parameter
# list (template arguments select kernels; parameters do not), and how many lines were read.
# lean_report(<count> <min-count> <bad-var> <what>): fails when fewer than <min-count> symbols
# were read (not the program meant) or when the list in <bad-var> holds any name, listing them
# after "<what> (<n>):".
# Shared by check_symbols.cmake and check_compiled_symbols.cmake.
function(lean_read_symbols objects names_var count_var)
  string(REPLACE "|" ";" objects "${objects}")
  set(names "")
  set(count 0)
  foreach(obj IN LISTS objects)
    execute_process(COMMAND "${NM}" -C --defined-only "${obj}" OUTPUT_VARIABLE text RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "${NM} failed on ${obj}")
    endif()
    string(REPLACE ";" "," text "${text}")
    string(REPLACE "\n" ";" lines "${text}")
    foreach(line IN LISTS lines)
      math(EXPR count "${count} + 1")
      # "<address> <type> <name>" -> "<type> <name up to its parameter list>"
      string(REGEX REPLACE "^[0-9a-f]* *([A-Za-z]) " "\\1 " entry "${line}")
      string(REPLACE "decltype(auto) " "" entry "${entry}")
      string(REGEX REPLACE "\\(.*" "" entry "${entry}")
      list(APPEND names "${entry}")
    endforeach()
  endforeach()
  set(${names_var} "${names}" PARENT_SCOPE)
  set(${count_var} "${count}" PARENT_SCOPE)
endfunction()

function(lean_report count min_count bad_var what)
  if(count LESS min_count)
    message(FATAL_ERROR "only ${count} symbols read from ${OBJECTS}: is this the float-only program?")
  endif()
  set(bad "${${bad_var}}")
  if(bad)
    list(REMOVE_DUPLICATES bad)
    list(LENGTH bad n)
    list(JOIN bad "\n  " shown)
    message(FATAL_ERROR "${what} (${n}):\n  ${shown}")
  endif()
endfunction()
