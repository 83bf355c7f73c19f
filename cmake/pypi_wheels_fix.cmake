# Injected with -DCMAKE_PROJECT_INCLUDE by scripts/setup.sh only, never on a robot's colcon build.
#
# The ROS 2 wheels on PyPI export CMake targets whose include directories point at the machine that
# built them (/opt/python/cp3XX-.../include and its numpy). At the end of configuration, this
# replaces those entries with this interpreter's Python and NumPy include directories, so that the
# package's own CMakeLists.txt stays the standard one.
find_package(Python3 REQUIRED COMPONENTS Interpreter Development NumPy)

function(deltas_fix_wheel_include_dirs)
  get_property(targets DIRECTORY "${CMAKE_SOURCE_DIR}" PROPERTY IMPORTED_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(dirs ${target} INTERFACE_INCLUDE_DIRECTORIES)
    if(NOT dirs)
      continue()
    endif()
    set(fixed "")
    foreach(dir IN LISTS dirs)
      if(dir MATCHES "^/opt/python/.*numpy")
        list(APPEND fixed ${Python3_NumPy_INCLUDE_DIRS})
      elseif(dir MATCHES "^/opt/python/")
        list(APPEND fixed ${Python3_INCLUDE_DIRS})
      else()
        list(APPEND fixed "${dir}")
      endif()
    endforeach()
    list(REMOVE_DUPLICATES fixed)
    set_target_properties(${target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${fixed}")
  endforeach()
endfunction()

cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL deltas_fix_wheel_include_dirs)
