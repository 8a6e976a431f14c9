// Framework-free basics shared by every kernel: dtypes, status codes, host/device macros.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#if defined(__CUDACC__)
#define SRT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SRT_HOST_DEVICE inline
#endif

namespace sarathi_rt {

// Storage dtypes of activations and the KV cache. Accumulation is always float32.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

SRT_HOST_DEVICE int dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

enum class StatusCode : int32_t { kOk = 0, kInvalidArgument = 1, kUnsupported = 2, kDeviceError = 3 };

// Launchers return a Status instead of throwing, so the kernels stay usable from any
// host language; the bindings turn a failure into a Python exception.
struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;

  static Status Ok() { return {}; }
  static Status Invalid(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status Unsupported(std::string msg) { return {StatusCode::kUnsupported, std::move(msg)}; }
  static Status DeviceError(std::string msg) { return {StatusCode::kDeviceError, std::move(msg)}; }
  bool ok() const { return code == StatusCode::kOk; }
};

}  // namespace sarathi_rt
