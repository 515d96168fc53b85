# Generates single_include/lazytensor/lazytensor.hpp from include/lazytensor/lazytensor.hpp
# and the opt-in include/lazytensor/eigen.hpp.
#
#   cmake -P scripts/amalgamate.cmake               # (re)generate the single header
#   cmake -DCHECK=ON -P scripts/amalgamate.cmake    # fail if the committed single header is stale
#
# Works from any working directory. Optional: -DOUTPUT=<path> to write elsewhere.
# (-D options must come before -P.)
#
# Rules:
#   * Starting at the umbrella, then eigen.hpp (the opt-in adapter it leaves out), every
#     `#include <lazytensor/...>` and every `#include "..."` that resolves to a file under
#     include/lazytensor is inlined, recursively, each file exactly once (first occurrence
#     wins, like #pragma once).
#   * `#pragma once` lines are dropped from inlined files; the output starts with a banner
#     and a single `#pragma once`.
#   * All other includes (<vector>, <Eigen/...>, <xsimd/...>, ...) stay in place.
#   * An internal include inside #if/#ifdef is an error: inlining it "once" at a conditional
#     site is not equivalent to the original program.
#   * The output is deterministic: no timestamps, no absolute paths.
cmake_minimum_required(VERSION 3.20)

get_filename_component(LT_ROOT "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
set(LT_INCLUDE_DIR "${LT_ROOT}/include")
set(LT_PKG_DIR "${LT_INCLUDE_DIR}/lazytensor")
set(LT_UMBRELLA "${LT_PKG_DIR}/lazytensor.hpp")
set(LT_COMMITTED "${LT_ROOT}/single_include/lazytensor/lazytensor.hpp")
if(NOT DEFINED OUTPUT OR OUTPUT STREQUAL "")
  set(OUTPUT "${LT_COMMITTED}")
endif()
get_filename_component(OUTPUT "${OUTPUT}" ABSOLUTE)  # relative to the caller's cwd

if(NOT EXISTS "${LT_UMBRELLA}")
  message(FATAL_ERROR "amalgamate: umbrella header not found: ${LT_UMBRELLA}")
endif()

# Placeholders so that file content survives CMake list handling.
string(ASCII 1 LT_SEMI)
string(ASCII 2 LT_LBR)
string(ASCII 3 LT_RBR)
string(ASCII 4 LT_BSL)

# Temporary output (also used in normal mode, so that the real output is only touched
# when its content changes).
if(DEFINED ENV{TMPDIR} AND IS_DIRECTORY "$ENV{TMPDIR}")
  set(_tmpdir "$ENV{TMPDIR}")
elseif(DEFINED ENV{TEMP} AND IS_DIRECTORY "$ENV{TEMP}")
  set(_tmpdir "$ENV{TEMP}")
elseif(IS_DIRECTORY "/tmp")
  set(_tmpdir "/tmp")
else()
  get_filename_component(_tmpdir "${OUTPUT}" DIRECTORY)
endif()
string(RANDOM LENGTH 12 _rand)
set(LT_TMP "${_tmpdir}/lazytensor-amalgamate-${_rand}.hpp")

set_property(GLOBAL PROPERTY LT_SEEN "")

# Remove the temporary file, then stop with an error.
function(_lt_fail)
  file(REMOVE "${LT_TMP}")
  string(JOIN "" msg ${ARGN})
  message(FATAL_ERROR "${msg}")
endfunction()

# Path of FILE relative to include/, for banners and messages.
function(_lt_rel out file)
  file(RELATIVE_PATH rel "${LT_INCLUDE_DIR}" "${file}")
  set(${out} "${rel}" PARENT_SCOPE)
endfunction()

# Undo the placeholders of one line.
function(_lt_unescape out line)
  string(REPLACE "${LT_BSL}" "\\" line "${line}")
  string(REPLACE "${LT_LBR}" "[" line "${line}")
  string(REPLACE "${LT_RBR}" "]" line "${line}")
  string(REPLACE "${LT_SEMI}" ";" line "${line}")
  set(${out} "${line}" PARENT_SCOPE)
endfunction()

# Resolve an include to a file under include/lazytensor, or "" if it is not ours.
function(_lt_resolve out delim target including_file)
  set(result "")
  if(delim STREQUAL "<")
    if(target MATCHES "^lazytensor/")
      set(result "${LT_INCLUDE_DIR}/${target}")
      if(NOT EXISTS "${result}")
        _lt_rel(rel "${including_file}")
        _lt_fail("amalgamate: ${rel}: #include <${target}> not found under include/")
      endif()
    endif()
  else()
    get_filename_component(dir "${including_file}" DIRECTORY)
    foreach(candidate "${dir}/${target}" "${LT_INCLUDE_DIR}/${target}")
      get_filename_component(candidate "${candidate}" ABSOLUTE)
      if(EXISTS "${candidate}" AND NOT IS_DIRECTORY "${candidate}")
        string(FIND "${candidate}" "${LT_PKG_DIR}/" pos)
        if(pos EQUAL 0)
          set(result "${candidate}")
        endif()
        break()
      endif()
    endforeach()
  endif()
  if(result)
    get_filename_component(result "${result}" ABSOLUTE)
  endif()
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

# Append the (escaped) text to the output file, undoing placeholders.
function(_lt_flush text)
  if(NOT text STREQUAL "")
    _lt_unescape(text "${text}")
    file(APPEND "${LT_TMP}" "${text}")
  endif()
endfunction()

function(_lt_inline file)
  get_property(seen GLOBAL PROPERTY LT_SEEN)
  if(file IN_LIST seen)
    return()
  endif()
  set_property(GLOBAL APPEND PROPERTY LT_SEEN "${file}")
  _lt_rel(rel "${file}")

  file(READ "${file}" content)
  string(REPLACE "\r\n" "\n" content "${content}")
  string(REPLACE "\\" "${LT_BSL}" content "${content}")
  string(REPLACE "[" "${LT_LBR}" content "${content}")
  string(REPLACE "]" "${LT_RBR}" content "${content}")
  string(REPLACE ";" "${LT_SEMI}" content "${content}")
  string(REGEX REPLACE "\n$" "" content "${content}")
  string(REPLACE "\n" ";" lines "${content}")

  set(chunk "// ---- begin ${rel} ----\n")
  set(depth 0)
  set(lineno 0)
  foreach(line IN LISTS lines)
    math(EXPR lineno "${lineno} + 1")
    if(line MATCHES "^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$")
      continue()
    endif()
    if(line MATCHES "^[ \t]*#[ \t]*if")            # #if, #ifdef, #ifndef
      math(EXPR depth "${depth} + 1")
    elseif(line MATCHES "^[ \t]*#[ \t]*endif")
      math(EXPR depth "${depth} - 1")
    elseif(line MATCHES "^[ \t]*#[ \t]*include[ \t]*([<\"])([^>\"]+)[>\"]")
      set(delim "${CMAKE_MATCH_1}")
      _lt_unescape(target "${CMAKE_MATCH_2}")
      _lt_resolve(resolved "${delim}" "${target}" "${file}")
      if(resolved)
        if(depth GREATER 0)
          _lt_fail(
            "amalgamate: ${rel}:${lineno}: internal header '${target}' is included inside "
            "#if/#ifdef, which the single header cannot reproduce. Include it unconditionally.")
        endif()
        _lt_flush("${chunk}")
        set(chunk "")
        _lt_inline("${resolved}")
        continue()
      endif()
    endif()
    string(APPEND chunk "${line}\n")
  endforeach()
  string(APPEND chunk "// ---- end ${rel} ----\n")
  _lt_flush("${chunk}")
endfunction()

file(WRITE "${LT_TMP}"
"// lazytensor — single-header distribution, generated from include/lazytensor/lazytensor.hpp
// and the opt-in include/lazytensor/eigen.hpp.
//
// GENERATED FILE — DO NOT EDIT. Regenerate with:
//   cmake -P scripts/amalgamate.cmake
//
// SPDX-License-Identifier: MIT
// Copyright (c) 2026 The lazytensor authors
#pragma once

")
_lt_inline("${LT_UMBRELLA}")
# The opt-in adapter the umbrella leaves out: a single-header user is header-only, so parses
# Eigen already (the products the packed GEMM does not take), and has no other file to include.
_lt_inline("${LT_PKG_DIR}/eigen.hpp")

if(CHECK)
  set(_ok FALSE)
  if(EXISTS "${OUTPUT}")
    file(SHA256 "${OUTPUT}" _old)
    file(SHA256 "${LT_TMP}" _new)
    if(_old STREQUAL _new)
      set(_ok TRUE)
    endif()
  endif()
  file(REMOVE "${LT_TMP}")
  file(RELATIVE_PATH _rel_out "${LT_ROOT}" "${OUTPUT}")
  if(NOT _ok)
    message(FATAL_ERROR
      "amalgamate: ${_rel_out} is stale or missing.\n"
      "Regenerate it from the repository root with:\n"
      "  cmake -P scripts/amalgamate.cmake\n"
      "and commit the result.")
  endif()
  message(STATUS "amalgamate: ${_rel_out} is up to date")
else()
  get_filename_component(_outdir "${OUTPUT}" DIRECTORY)
  file(MAKE_DIRECTORY "${_outdir}")
  configure_file("${LT_TMP}" "${OUTPUT}" COPYONLY)   # only rewrites when content changed
  file(REMOVE "${LT_TMP}")
  message(STATUS "amalgamate: wrote ${OUTPUT}")
endif()
