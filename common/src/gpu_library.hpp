// Opening a GPU library the first time it is needed (dlopen), instead of linking it. A
// linked library is loaded, and its static initializers run, when any program starts:
// libcublas pulls in libcublasLt, whose start-up alone holds about 210 MB of memory and
// takes a few tenths of a second, in every program, on the CPU too. So cuda.cu opens cuBLAS
// at the first GPU matmul and comm_nccl.cpp opens NCCL at the first NCCL communicator;
// the CUDA runtime itself is linked in statically (small, and it loads the driver only on
// its first call). (Internal to the library; included by the CUDA and NCCL sources only.)
//
// Each library is described by a list of its functions, an X macro:
//   #define CUBLAS_FUNCTIONS(X) X(cublasCreate) X(cublasSgemm) ...
// from which SHARDLAB_GPU_DECLARE makes a struct of pointers, one per function, with the
// function's own name and type, and SHARDLAB_GPU_BIND fills it in with dlsym. A name that
// the header defines as a macro (cuBLAS's cublasCreate is cublasCreate_v2) is expanded
// before it is looked up, so the symbol is the one the header would have called.
#pragma once

#include <dlfcn.h>

#include <initializer_list>
#include <string>

#include "shardlab/check.hpp"

namespace shardlab::gpu {

/// dlopen()s the first of `files` that loads and returns its handle, never closed; throws
/// Error naming `what` and why each failed. A bare file name ("libcublas.so.13") is found
/// as the dynamic linker finds a linked library: LD_LIBRARY_PATH, the program's RUNPATH
/// (the CUDA toolkit's library folder, see common/CMakeLists.txt), ld.so.cache.
inline void* open_library(const char* what, std::initializer_list<const char*> files) {
  std::string why;
  for (const char* file : files) {
    if (void* lib = dlopen(file, RTLD_NOW | RTLD_LOCAL)) return lib;
    const char* error = dlerror();
    why += std::string("\n  ") + (error ? error : file);
  }
  throw Error("cannot load " + std::string(what) + " (needed on the GPU):" + why);
}

/// Sets `function` to the symbol `name` of `lib`; throws Error when it has none.
template <class F>
void bind(void* lib, F& function, const char* what, const char* name) {
  function = reinterpret_cast<F>(dlsym(lib, name));
  if (!function)
    throw Error("cannot load " + std::string(what) + ": it has no " + name +
                " (older than the headers this program was built with?)");
}

}  // namespace shardlab::gpu

#define SHARDLAB_GPU_NAME_(function) #function
#define SHARDLAB_GPU_NAME(function) SHARDLAB_GPU_NAME_(function)
#define SHARDLAB_GPU_POINTER_(function) decltype(&::function) function = nullptr;
/// The members of a struct of pointers to the functions of FUNCTIONS.
#define SHARDLAB_GPU_DECLARE(FUNCTIONS) FUNCTIONS(SHARDLAB_GPU_POINTER_)
/// Fills `api` (such a struct) in from `lib`; `what` names the library in errors.
#define SHARDLAB_GPU_BIND(FUNCTIONS, api, lib, what) \
  do {                                               \
    auto& shardlab_api_ = (api);                     \
    void* shardlab_lib_ = (lib);                     \
    const char* shardlab_what_ = (what);             \
    FUNCTIONS(SHARDLAB_GPU_BIND_ONE_)                \
  } while (false)
#define SHARDLAB_GPU_BIND_ONE_(function)                                       \
  ::shardlab::gpu::bind(shardlab_lib_, shardlab_api_.function, shardlab_what_, \
                        SHARDLAB_GPU_NAME(function));
