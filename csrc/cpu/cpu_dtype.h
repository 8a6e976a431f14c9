// Conversions between the storage dtypes and float32 on the CPU.
#pragma once

#include <cstdint>
#include <cstring>

namespace sarathi_rt::cpu {

struct bf16 {
  uint16_t bits;
};
using f16 = _Float16;

inline float to_float(float x) { return x; }
inline float to_float(f16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline f16 from_float<f16>(float x) { return static_cast<f16>(x); }
template <>
inline bf16 from_float<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16{static_cast<uint16_t>(u >> 16)};
}

}  // namespace sarathi_rt::cpu
