// One element of Adam or AdamW in the arithmetic of torch's fused CPU kernel: its SIMD lanes and its
// scalar tail, each rounding once where that kernel's build fuses a multiply-add. Shared by the
// kernels that step fp32 moments (adam.cpp) and compact ones (moments.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

namespace tz {

struct AdamHypers {
  float decay;      // AdamW: 1 - lr * weight_decay, the parameter's factor
  float wd;         // Adam: the weight decay added to the gradient
  float c1, c2, beta2, bc2_sqrt, eps, step_size;
  bool adamw, decays;
};

// The per-step constants as torch's fused kernel derives them from its double hyper-parameters.
inline AdamHypers adam_hypers(bool adamw, double lr, double beta1, double beta2, double weight_decay, double eps,
                              double step) {
  double bc1 = 1 - std::pow(beta1, step);
  double bc2 = 1 - std::pow(beta2, step);
  AdamHypers h;
  h.decay = float(1 - lr * weight_decay);
  h.wd = float(weight_decay);
  h.c1 = float(1 - beta1);
  h.c2 = float(1 - beta2);
  h.beta2 = float(beta2);
  h.bc2_sqrt = float(std::sqrt(bc2));
  h.eps = float(eps);
  h.step_size = float(lr / bc1);
  h.adamw = adamw;
  h.decays = weight_decay != 0;
  return h;
}

// One element of torch's vector path: the lerp and the second moment each rounded once by an FMA.
inline float adam_vector(float p, float g, float& m, float& v, const AdamHypers& h) {
  if (h.decays) {
    if (h.adamw) p = p * h.decay;
    else g = std::fma(p, h.wd, g);
  }
  m = std::fma(h.c1, g - m, m);
  v = std::fma(h.c2 * g, g, v * h.beta2);
  float denom = std::sqrt(v) / h.bc2_sqrt + h.eps;
  return p + (-h.step_size * m) / denom;
}

// One element of torch's scalar tail, which the compiler contracted differently.
inline float adam_scalar(float p, float g, float& m, float& v, const AdamHypers& h) {
  if (h.decays) {
    if (h.adamw) p = p * h.decay;
    else g = std::fma(p, h.wd, g);
  }
  m = std::fma(h.c1, g - m, m);
  v = std::fma(v, h.beta2, (h.c2 * g) * g);
  float denom = std::sqrt(v) / h.bc2_sqrt + h.eps;
  return p - (h.step_size * m) / denom;
}

// A gradient element in fp32: as it is, or widened from bf16.
inline float widen(float g) { return g; }
inline float widen(uint16_t g) { return bf16_to_float(g); }

}  // namespace tz
