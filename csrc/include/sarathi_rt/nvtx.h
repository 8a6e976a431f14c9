// NVTX ranges for nsys timelines (and any tool loaded through NVTX_INJECTION64_PATH), in
// one domain, "sarathi_rt", for the core's op ranges and the Python ranges it pushes for
// the engine. NVTX3 is header-only: CMake defines SARATHI_RT_WITH_NVTX when it finds
// <nvtx3/nvToolsExt.h> (CUDA toolkit or the nvidia-nvtx wheel); without it every range
// is a no-op. The ops' ranges fire per layer, so they are detail: only with
// SARATHI_RT_NVTX=detail in the environment (read once), the switch the Python side reads.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(SARATHI_RT_WITH_NVTX)
#include <nvtx3/nvToolsExt.h>
#endif

namespace sarathi_rt {

#if defined(SARATHI_RT_WITH_NVTX)
constexpr bool kHaveNvtx = true;

inline nvtxDomainHandle_t nvtx_domain() {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("sarathi_rt");
  return domain;
}

inline void nvtx_push(const char* name, uint32_t argb) {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.colorType = NVTX_COLOR_ARGB;
  a.color = argb;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  nvtxDomainRangePushEx(nvtx_domain(), &a);
}

inline void nvtx_pop() { nvtxDomainRangePop(nvtx_domain()); }
#else
constexpr bool kHaveNvtx = false;

inline void nvtx_push(const char*, uint32_t) {}
inline void nvtx_pop() {}
#endif

inline bool nvtx_detail() {
  static const bool on = [] {
    const char* v = std::getenv("SARATHI_RT_NVTX");
    return v != nullptr && std::strcmp(v, "detail") == 0;
  }();
  return on;
}

// A detail range over one op call: pushed on construction, popped on destruction (also
// when the op throws), nothing at all without SARATHI_RT_NVTX=detail.
class NvtxOpRange {
 public:
  explicit NvtxOpRange(const char* name) : on_(kHaveNvtx && nvtx_detail()) {
    if (on_) nvtx_push(name, 0xFFE07020u);  // orange: the core's ops
  }
  ~NvtxOpRange() {
    if (on_) nvtx_pop();
  }
  NvtxOpRange(const NvtxOpRange&) = delete;
  NvtxOpRange& operator=(const NvtxOpRange&) = delete;

 private:
  bool on_;
};

}  // namespace sarathi_rt
