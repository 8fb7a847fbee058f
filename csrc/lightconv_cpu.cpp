// Native CPU lightweight and dynamic convolution (Wu et al. 2019): forward, gradients, decoding step.
//
// Same math, layout and checks as ds_chimera/ops/reference.py:
//   x (B, C, T); LightConv weight (H, K); DynamicConv weight (B, H, K, T); head h = c / (C / H);
//   y[b,c,t] = sum_k w[h,k] (or w[b,h,k,t]) * x[b,c,t+k-P], zero outside [0, T), P in [0, K-1].
//
// Every tensor is read through its strides, so the layers' T x B x C activations (a (B, C, T)
// view whose channels are contiguous) need no transpose. Two loop orders:
//   * rows: one (b, c) row at a time, copied into a zero-padded accumulator-typed buffer, so
//     the inner loops are branch-free contiguous loops over t ("for each k: out[t] += w_k *
//     xp[t + k]"). For tensors whose time steps are contiguous (or any other layout).
//   * channels-last: one (b, chunk of 64 steps) at a time, walking t; per step every head and
//     block of up to 64 contiguous channels, accumulated in registers. For tensors whose
//     channels are contiguous (T x B x C, B x T x C).
// Outputs take the input's layout (at::empty_like), and the fused backward computes both
// gradients in one pass over grad_y and x. Accumulation is fp32 for fp32/fp16/bf16 and fp64
// for fp64. Work is split with at::parallel_for (OpenMP) into tasks that each own their
// outputs and sum in a fixed order, so results do not depend on the thread count.

#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t kGrainWork = 32768;  // multiply-adds per task below which we stay serial
constexpr int64_t kTimeBlock = 2048;   // t-block keeping a row's working set in L1/L2
constexpr int64_t kChannelBlock = 64;  // channels a channels-last loop keeps in registers (at most)
constexpr int64_t kStepBlock = 256;    // t-block of the channels-last weight gradient

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, work_per_item));
}

// ---------------------------------------------------------------------------------------------
// Validation (messages mirror reference.check_shapes)
// ---------------------------------------------------------------------------------------------

struct Dims {
  int64_t B, C, T, H, K, G;
};

void check_cpu_float(const char* op, const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got device ", t.device());
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16,
                   op, ": ", name, " must be float32, float64, float16 or bfloat16, got ", st);
}

void check_same_dtype(const char* op, const Tensor& a, const char* an, const Tensor& b, const char* bn) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), op, ": ", an, " and ", bn,
                   " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
}

void check_heads_padding(const char* op, int64_t C, int64_t H, int64_t K, int64_t P) {
  TORCH_CHECK_VALUE(H >= 1 && C % H == 0, op, ": the number of heads must divide the channels: H=", H,
                    ", C=", C);
  TORCH_CHECK_VALUE(K >= 1, op, ": kernel size K must be >= 1, got ", K);
  TORCH_CHECK_VALUE(0 <= P && P < K, op, ": padding_l must be in [0, K-1] = [0, ", K - 1, "], got ", P);
}

// x-like tensor (B, C, T) and a weight; dynamic weight is (B, H, K, T), static (H, K).
Dims check_conv(const char* op, const Tensor& x, const char* xname, const Tensor& w, int64_t P, bool dynamic) {
  check_cpu_float(op, x, xname);
  check_cpu_float(op, w, "weight");
  check_same_dtype(op, x, xname, w, "weight");
  TORCH_CHECK_VALUE(x.dim() == 3, op, ": ", xname, " must be (B, C, T), got shape ", x.sizes());
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2);
  int64_t H, K;
  if (dynamic) {
    TORCH_CHECK_VALUE(w.dim() == 4 && w.size(0) == B && w.size(3) == T, op, ": dynamic weight must be (B=", B,
                      ", H, K, T=", T, "), got ", w.sizes());
    H = w.size(1);
    K = w.size(2);
  } else {
    TORCH_CHECK_VALUE(w.dim() == 2, op, ": lightconv weight must be (H, K), got shape ", w.sizes());
    H = w.size(0);
    K = w.size(1);
  }
  check_heads_padding(op, C, H, K, P);
  return {B, C, T, H, K, C / H};
}

Dims check_weight_grad(const char* op, const Tensor& gy, const Tensor& x, int64_t P, int64_t H, int64_t K) {
  check_cpu_float(op, gy, "grad_y");
  check_cpu_float(op, x, "x");
  check_same_dtype(op, gy, "grad_y", x, "x");
  TORCH_CHECK_VALUE(x.dim() == 3, op, ": x must be (B, C, T), got shape ", x.sizes());
  TORCH_CHECK_VALUE(gy.sizes() == x.sizes(), op, ": grad_y must have the shape of x ", x.sizes(), ", got ",
                    gy.sizes());
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2);
  check_heads_padding(op, C, H, K, P);
  return {B, C, T, H, K, C / H};
}

// ---------------------------------------------------------------------------------------------
// Layouts
// ---------------------------------------------------------------------------------------------

// Element strides of a (B, C, T) tensor.
struct S3 {
  int64_t b, c, t;
  explicit S3(const Tensor& x) : b(x.stride(0)), c(x.stride(1)), t(x.stride(2)) {}
};

// Channels contiguous and time not: the layers' T x B x C (or B x T x C) activations.
bool channels_last(const Tensor& x) {
  return x.size(1) > 1 && x.stride(1) == 1 && x.size(2) > 1 && x.stride(2) != 1;
}

// grad_y in x's layout: the loops read both through one stride set (a copy only if they differ).
Tensor like(const Tensor& t, const Tensor& x) {
  if (t.strides() == x.strides()) return t;
  Tensor out = at::empty_like(x);
  out.copy_(t);
  return out;
}

// (H, K) kernel as acc_t, optionally reversed along K (the input gradient's kernel).
template <typename scalar_t, typename acc_t>
std::vector<acc_t> head_kernel(const Tensor& w_, bool flip) {
  const Tensor w = w_.contiguous();
  const int64_t H = w.size(0), K = w.size(1);
  const scalar_t* wp = w.const_data_ptr<scalar_t>();
  std::vector<acc_t> out(H * K);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t k = 0; k < K; ++k) out[h * K + k] = static_cast<acc_t>(wp[h * K + (flip ? K - 1 - k : k)]);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Row helpers
// ---------------------------------------------------------------------------------------------

// dst[0 : n + pad_l + pad_r] = [0]*pad_l ++ acc(src[0:n:stride]) ++ [0]*pad_r
template <typename scalar_t, typename acc_t>
inline void load_padded(const scalar_t* src, int64_t stride, int64_t n, int64_t pad_l, int64_t pad_r, acc_t* dst) {
  std::fill(dst, dst + pad_l, acc_t(0));
  if (stride == 1) {
    for (int64_t i = 0; i < n; ++i) dst[pad_l + i] = static_cast<acc_t>(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[pad_l + i] = static_cast<acc_t>(src[i * stride]);
  }
  std::fill(dst + pad_l + n, dst + pad_l + n + pad_r, acc_t(0));
}

template <typename scalar_t, typename acc_t>
inline void store(const acc_t* src, int64_t n, scalar_t* dst, int64_t stride) {
  if (stride == 1) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i * stride] = static_cast<scalar_t>(src[i]);
  }
}

// out[t] = sum_k w[k] * xp[t + k], t in [0, T)  (xp has T + K - 1 entries)
template <typename acc_t>
inline void correlate_static(const acc_t* __restrict__ xp, const acc_t* __restrict__ w, int64_t K, int64_t T,
                             acc_t* __restrict__ out) {
  for (int64_t t0 = 0; t0 < T; t0 += kTimeBlock) {
    const int64_t n = std::min(kTimeBlock, T - t0);
    acc_t* __restrict__ o = out + t0;
    std::fill(o, o + n, acc_t(0));
    for (int64_t k = 0; k < K; ++k) {
      const acc_t wk = w[k];
      const acc_t* __restrict__ xs = xp + t0 + k;
      for (int64_t t = 0; t < n; ++t) o[t] += wk * xs[t];
    }
  }
}

// out[t] = sum_k w[k*T + t] * xp[t + k]
template <typename acc_t>
inline void correlate_dynamic(const acc_t* __restrict__ xp, const acc_t* __restrict__ w, int64_t K, int64_t T,
                              acc_t* __restrict__ out) {
  for (int64_t t0 = 0; t0 < T; t0 += kTimeBlock) {
    const int64_t n = std::min(kTimeBlock, T - t0);
    acc_t* __restrict__ o = out + t0;
    std::fill(o, o + n, acc_t(0));
    for (int64_t k = 0; k < K; ++k) {
      const acc_t* __restrict__ wk = w + k * T + t0;
      const acc_t* __restrict__ xs = xp + t0 + k;
      for (int64_t t = 0; t < n; ++t) o[t] += wk[t] * xs[t];
    }
  }
}

// acc[t + k] += w[k*T + t] * g[t]: the dynamic input gradient scattered into a padded row.
template <typename acc_t>
inline void scatter_dynamic(const acc_t* __restrict__ g, const acc_t* __restrict__ w, int64_t K, int64_t T,
                            acc_t* __restrict__ acc) {
  for (int64_t t0 = 0; t0 < T; t0 += kTimeBlock) {
    const int64_t n = std::min(kTimeBlock, T - t0);
    for (int64_t k = 0; k < K; ++k) {
      const acc_t* __restrict__ wk = w + k * T + t0;
      const acc_t* __restrict__ gs = g + t0;
      acc_t* __restrict__ o = acc + t0 + k;
      for (int64_t t = 0; t < n; ++t) o[t] += wk[t] * gs[t];
    }
  }
}

// sum_i a[i] * b[i] with 8 independent partial sums: vectorisable without -ffast-math and
// still a fixed summation order.
template <typename acc_t>
inline acc_t dot(const acc_t* __restrict__ a, const acc_t* __restrict__ b, int64_t n) {
  acc_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) s[i & 7] += a[i] * b[i];
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

// One (b, h) block of a dynamic kernel, (K, T) as acc_t and contiguous in t.
template <typename scalar_t, typename acc_t>
inline void load_dynamic_block(const scalar_t* w, int64_t sk, int64_t st, int64_t K, int64_t T, acc_t* dst) {
  for (int64_t k = 0; k < K; ++k) load_padded(w + k * sk, st, T, 0, 0, dst + k * T);
}

// ---------------------------------------------------------------------------------------------
// Channels-last helpers: a block of n <= kChannelBlock contiguous channels of one head
// ---------------------------------------------------------------------------------------------

// out[j] = sum over taps k with rows[k] != nullptr of coef[k] * rows[k][j], j < n; N a
// compile-time width (the accumulators stay in registers), or 0 for any n <= kChannelBlock.
template <int64_t N, typename scalar_t, typename acc_t>
inline void weighted_rows_n(const scalar_t* const* rows, const acc_t* coef, int64_t K, int64_t n, acc_t* out) {
  constexpr int64_t width = N > 0 ? N : kChannelBlock;
  const int64_t m = N > 0 ? N : n;
  acc_t a[width];
  std::fill(a, a + width, acc_t(0));
  for (int64_t k = 0; k < K; ++k) {
    const scalar_t* __restrict__ r = rows[k];
    if (r == nullptr) continue;
    const acc_t wk = coef[k];
    for (int64_t j = 0; j < m; ++j) a[j] += wk * static_cast<acc_t>(r[j]);
  }
  std::copy(a, a + m, out);
}

template <typename scalar_t, typename acc_t>
inline void weighted_rows(const scalar_t* const* rows, const acc_t* coef, int64_t K, int64_t n, acc_t* out) {
  if (n == 64) return weighted_rows_n<64>(rows, coef, K, n, out);
  if (n == 32) return weighted_rows_n<32>(rows, coef, K, n, out);
  if (n == 16) return weighted_rows_n<16>(rows, coef, K, n, out);
  weighted_rows_n<0>(rows, coef, K, n, out);
}

// sum_j a[j] * b[j] over a block of contiguous channels, in a fixed order.
template <typename scalar_t, typename acc_t>
inline acc_t channel_dot(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return dot(a, b, n);
  } else {
    acc_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) s[j] += static_cast<acc_t>(a[i + j]) * static_cast<acc_t>(b[i + j]);
    for (; i < n; ++i) s[i & 7] += static_cast<acc_t>(a[i]) * static_cast<acc_t>(b[i]);
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
  }
}

// Channels-last tasks are (batch, chunk of kStepChunk steps): each walks its steps in order and,
// per step, every head and block of channels, so the K input rows it reads (C contiguous
// values each) stay in cache and memory is read in whole rows.
constexpr int64_t kStepChunk = 64;

inline int64_t chunks(int64_t T) { return (T + kStepChunk - 1) / kStepChunk; }

// y[b, t, :] = per head h, sum_k coef(h, t)[k] * x[b, t + k - pad_l, channels of h], t in [t0, t1):
// the forward (coef = w) and both input gradients (LightConv: w reversed; DynamicConv: w at
// the source step). Channels contiguous in x; y through its strides.
template <typename scalar_t, typename acc_t, typename Coef>
void cl_correlate(const scalar_t* x, S3 xs, scalar_t* y, S3 ys, const Dims& d, int64_t pad_l, int64_t b,
                  int64_t t0, int64_t t1, Coef&& coef_at) {
  std::vector<const scalar_t*> base(d.K), rows(d.K);
  std::vector<acc_t> coef(d.K);
  acc_t out[kChannelBlock];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t k = 0; k < d.K; ++k) {
      const int64_t s = t + k - pad_l;
      base[k] = (s >= 0 && s < d.T) ? x + b * xs.b + s * xs.t : nullptr;
    }
    for (int64_t h = 0; h < d.H; ++h) {
      coef_at(h, t, coef.data());
      for (int64_t c0 = h * d.G; c0 < (h + 1) * d.G; c0 += kChannelBlock) {
        const int64_t n = std::min(kChannelBlock, (h + 1) * d.G - c0);
        for (int64_t k = 0; k < d.K; ++k) rows[k] = base[k] ? base[k] + c0 : nullptr;
        weighted_rows(rows.data(), coef.data(), d.K, n, out);
        store(out, n, y + b * ys.b + t * ys.t + c0 * ys.c, ys.c);
      }
    }
  }
}

// part[h * K + k] += sum over t in [t0, t1) and the channels c of head h of
// g[b, t, c] * x[b, t + k - P, c]; a block of 32 channels accumulates in registers over the steps.
template <typename scalar_t, typename acc_t>
void cl_light_weight_grad(const scalar_t* g, const scalar_t* x, S3 s, const Dims& d, int64_t P, int64_t b,
                          int64_t t0, int64_t t1, acc_t* part) {
  acc_t a[kChannelBlock];
  for (int64_t h = 0; h < d.H; ++h) {
    for (int64_t c0 = h * d.G; c0 < (h + 1) * d.G; c0 += kChannelBlock) {
      const int64_t n = std::min(kChannelBlock, (h + 1) * d.G - c0);
      for (int64_t k = 0; k < d.K; ++k) {
        const int64_t lo = std::max(t0, P - k), hi = std::min(t1, d.T + P - k);   // t + k - P in [0, T)
        if (lo >= hi) continue;
        std::fill(a, a + kChannelBlock, acc_t(0));
        const scalar_t* gr = g + b * s.b + c0;
        const scalar_t* xr = x + b * s.b + (k - P) * s.t + c0;
        if (n == kChannelBlock) {   // a fixed width: the sums stay in registers
          for (int64_t t = lo; t < hi; ++t) {
            const scalar_t* __restrict__ gv = gr + t * s.t;
            const scalar_t* __restrict__ xv = xr + t * s.t;
            for (int64_t j = 0; j < kChannelBlock; ++j) a[j] += static_cast<acc_t>(gv[j]) * static_cast<acc_t>(xv[j]);
          }
        } else {
          for (int64_t t = lo; t < hi; ++t)
            for (int64_t j = 0; j < n; ++j)
              a[j] += static_cast<acc_t>(gr[t * s.t + j]) * static_cast<acc_t>(xr[t * s.t + j]);
        }
        acc_t sum = 0;
        for (int64_t j = 0; j < n; ++j) sum += a[j];
        part[h * d.K + k] += sum;
      }
    }
  }
}

// gw[b, h, k, t] = sum over the head's channels of g[b, t, c] * x[b, t + k - P, c], t in [t0, t1)
template <typename scalar_t, typename acc_t>
void cl_dynamic_weight_grad(const scalar_t* g, const scalar_t* x, S3 s, scalar_t* gw, const int64_t* ws,
                            const Dims& d, int64_t P, int64_t b, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t h = 0; h < d.H; ++h) {
      const int64_t c0 = h * d.G;
      const scalar_t* gr = g + b * s.b + t * s.t + c0;
      scalar_t* base = gw + b * ws[0] + h * ws[1] + t * ws[3];
      for (int64_t k = 0; k < d.K; ++k) {
        const int64_t src = t + k - P;
        const acc_t v = (src >= 0 && src < d.T)
                            ? channel_dot<scalar_t, acc_t>(gr, x + b * s.b + src * s.t + c0, d.G) : acc_t(0);
        base[k * ws[2]] = static_cast<scalar_t>(v);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// LightConv
// ---------------------------------------------------------------------------------------------

// out[b, c, t] = sum_k w[h, k] * in[b, c, t + k - pad_l]: the forward (w as is, pad P) and the
// input gradient (w reversed, pad K-1-P).
Tensor lightconv_apply(const Tensor& in, const Tensor& w, int64_t pad_l, bool flip, const Dims& d) {
  Tensor out = at::empty_like(in);
  if (out.numel() == 0) return out;
  const bool cl = channels_last(in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.scalar_type(), "lightconv_apply", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const std::vector<acc_t> wk = head_kernel<scalar_t, acc_t>(w, flip);
    const scalar_t* xin = in.const_data_ptr<scalar_t>();
    scalar_t* yp = out.mutable_data_ptr<scalar_t>();
    const S3 xs(in), ys(out);
    if (cl) {
      const int64_t per_b = chunks(d.T);
      at::parallel_for(0, d.B * per_b, grain_for(kStepChunk * d.C * d.K), [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / per_b, t0 = (task % per_b) * kStepChunk;
          cl_correlate<scalar_t, acc_t>(xin, xs, yp, ys, d, pad_l, b, t0, std::min(d.T, t0 + kStepChunk),
                                        [&](int64_t h, int64_t, acc_t* c) {
                                          std::copy(wk.data() + h * d.K, wk.data() + (h + 1) * d.K, c);
                                        });
        }
      });
      return;
    }
    at::parallel_for(0, d.B * d.C, grain_for(d.T * d.K), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> xp(d.T + d.K - 1), acc(d.T);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / d.C, c = r % d.C, h = c / d.G;
        load_padded(xin + b * xs.b + c * xs.c, xs.t, d.T, pad_l, d.K - 1 - pad_l, xp.data());
        correlate_static(xp.data(), wk.data() + h * d.K, d.K, d.T, acc.data());
        store(acc.data(), d.T, yp + b * ys.b + c * ys.c, ys.t);
      }
    });
  });
  return out;
}

Tensor lightconv_forward(const Tensor& x, const Tensor& w, int64_t padding_l) {
  const Dims d = check_conv("lightconv_forward", x, "x", w, padding_l, false);
  return lightconv_apply(x, w, padding_l, false, d);
}

// grad_x[s] = sum_k w[k] * grad_y[s - k + P] = sum_k w[K-1-k] * grad_y[s + k - (K-1-P)]
Tensor lightconv_backward_input(const Tensor& grad_y, const Tensor& w, int64_t padding_l) {
  const Dims d = check_conv("lightconv_backward_input", grad_y, "grad_y", w, padding_l, false);
  return lightconv_apply(grad_y, w, d.K - 1 - padding_l, true, d);
}

// grad_w[h,k] = sum_{b, c in h, t} grad_y[b,c,t] * x[b,c,t+k-P], and (with w) grad_x in the same
// pass over grad_y and x. Each task owns a K-vector of partial sums (a row, or a channel block),
// reduced over the tasks of a head in a fixed order.
std::tuple<Tensor, Tensor> lightconv_grads(const Tensor& grad_y_, const Tensor& x, const Tensor* w, int64_t P,
                                           const Dims& d) {
  const Tensor gy = like(grad_y_, x);
  Tensor grad_w = at::empty({d.H, d.K}, x.options());
  Tensor grad_x = w ? at::empty_like(gy) : Tensor();
  const bool cl = channels_last(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "lightconv_grads", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t K = d.K, T = d.T;
    const scalar_t* gp = gy.const_data_ptr<scalar_t>();
    const scalar_t* xin = x.const_data_ptr<scalar_t>();
    scalar_t* gxp = w ? grad_x.mutable_data_ptr<scalar_t>() : nullptr;
    const std::vector<acc_t> wflip = w ? head_kernel<scalar_t, acc_t>(*w, true) : std::vector<acc_t>();
    const S3 s(x), gs(gy);
    const S3 xs_out = w ? S3(grad_x) : s;
    // tasks: channels-last, (b, chunk of steps), each with an (H, K) partial; rows, (b, c) with a K one
    const int64_t tasks = cl ? d.B * chunks(T) : d.B * d.C;
    const int64_t width = cl ? d.H * K : K;
    std::vector<acc_t> partial(tasks * width, acc_t(0));
    if (T > 0 && tasks > 0) {
      at::parallel_for(0, tasks, grain_for(cl ? kStepChunk * d.C * K : T * K), [&](int64_t begin, int64_t end) {
        if (cl) {
          for (int64_t task = begin; task < end; ++task) {
            const int64_t b = task / chunks(T), t0 = (task % chunks(T)) * kStepChunk;
            const int64_t t1 = std::min(T, t0 + kStepChunk);
            cl_light_weight_grad(gp, xin, s, d, P, b, t0, t1, partial.data() + task * width);
            if (w)   // grad_x from the same steps while they are in cache
              cl_correlate<scalar_t, acc_t>(gp, gs, gxp, xs_out, d, K - 1 - P, b, t0, t1,
                                            [&](int64_t h, int64_t, acc_t* c) {
                                              std::copy(wflip.data() + h * K, wflip.data() + (h + 1) * K, c);
                                            });
          }
          return;
        }
        std::vector<acc_t> xp(T + K - 1), gpad(w ? T + K - 1 : 0), acc(w ? T : 0);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / d.C, c = task % d.C, h = c / d.G;
          load_padded(xin + b * s.b + c * s.c, s.t, T, P, K - 1 - P, xp.data());
          if (w) {   // grad_y padded for the input gradient; its middle is the row itself
            load_padded(gp + b * gs.b + c * gs.c, gs.t, T, K - 1 - P, P, gpad.data());
            correlate_static(gpad.data(), wflip.data() + h * K, K, T, acc.data());
            store(acc.data(), T, gxp + b * xs_out.b + c * xs_out.c, xs_out.t);
          } else {
            gpad.resize(T);
            load_padded(gp + b * gs.b + c * gs.c, gs.t, T, 0, 0, gpad.data());
          }
          const acc_t* grow = gpad.data() + (w ? K - 1 - P : 0);
          acc_t* pr = partial.data() + task * K;
          for (int64_t t0 = 0; t0 < T; t0 += kTimeBlock) {
            const int64_t n = std::min(kTimeBlock, T - t0);
            for (int64_t k = 0; k < K; ++k) pr[k] += dot(grow + t0, xp.data() + t0 + k, n);
          }
        }
      });
    }
    scalar_t* out = grad_w.mutable_data_ptr<scalar_t>();
    for (int64_t h = 0; h < d.H; ++h) {   // a fixed-order sum over the tasks
      for (int64_t k = 0; k < K; ++k) {
        acc_t sum = 0;
        if (cl) {
          for (int64_t task = 0; task < tasks; ++task) sum += partial[task * width + h * K + k];
        } else {
          for (int64_t b = 0; b < d.B; ++b)
            for (int64_t c = h * d.G; c < (h + 1) * d.G; ++c) sum += partial[(b * d.C + c) * K + k];
        }
        out[h * K + k] = static_cast<scalar_t>(sum);
      }
    }
  });
  return {grad_x, grad_w};
}

Tensor lightconv_backward_weight(const Tensor& grad_y, const Tensor& x, int64_t padding_l, int64_t heads,
                                 int64_t kernel_size) {
  const Dims d = check_weight_grad("lightconv_backward_weight", grad_y, x, padding_l, heads, kernel_size);
  return std::get<1>(lightconv_grads(grad_y, x, nullptr, padding_l, d));
}

// Both gradients in one pass: grad_y and x are each read once.
std::tuple<Tensor, Tensor> lightconv_backward(const Tensor& grad_y, const Tensor& x, const Tensor& w,
                                              int64_t padding_l) {
  const Dims d = check_conv("lightconv_backward", x, "x", w, padding_l, false);
  check_weight_grad("lightconv_backward", grad_y, x, padding_l, d.H, d.K);
  return lightconv_grads(grad_y, x, &w, padding_l, d);
}

// ---------------------------------------------------------------------------------------------
// DynamicConv
// ---------------------------------------------------------------------------------------------

struct S4 {
  int64_t v[4];
  explicit S4(const Tensor& w) : v{w.stride(0), w.stride(1), w.stride(2), w.stride(3)} {}
};

// y (forward: the kernel of the output step) or grad_x (the kernel of the source step).
Tensor dynamicconv_apply(const Tensor& in, const Tensor& w, int64_t P, bool input_grad, const Dims& d) {
  Tensor out = at::empty_like(in);
  if (out.numel() == 0) return out;
  const bool cl = channels_last(in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.scalar_type(), "dynamicconv_apply", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xin = in.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* yp = out.mutable_data_ptr<scalar_t>();
    const S3 xs(in), ys(out);
    const S4 ws(w);
    const int64_t K = d.K, T = d.T;
    if (cl) {
      const int64_t per_b = chunks(T);
      at::parallel_for(0, d.B * per_b, grain_for(kStepChunk * d.C * K), [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / per_b, t0 = (task % per_b) * kStepChunk;
          const scalar_t* wb = wp + b * ws.v[0];
          // forward: w[k, t]; input grad: gx[s] = sum_k w[k, t] gy[t], t = s - k + P, read as
          // the correlation of gy (pad K-1-P) with tap k' = K-1-k at step t = s + k' - (K-1-P)
          cl_correlate<scalar_t, acc_t>(xin, xs, yp, ys, d, input_grad ? K - 1 - P : P, b, t0,
                                        std::min(T, t0 + kStepChunk), [&](int64_t h, int64_t t, acc_t* c) {
            const scalar_t* wbh = wb + h * ws.v[1];
            for (int64_t k = 0; k < K; ++k) {
              if (!input_grad) {
                c[k] = static_cast<acc_t>(wbh[k * ws.v[2] + t * ws.v[3]]);
              } else {
                const int64_t src = t + k - (K - 1 - P);
                c[k] = (src >= 0 && src < T) ? static_cast<acc_t>(wbh[(K - 1 - k) * ws.v[2] + src * ws.v[3]])
                                             : acc_t(0);
              }
            }
          });
        }
      });
      return;
    }
    at::parallel_for(0, d.B * d.C, grain_for(T * K), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> xp(T + K - 1), acc(T), wblock(K * T);
      int64_t cached = -1;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / d.C, c = r % d.C, bh = b * d.H + c / d.G;
        if (bh != cached) {   // rows of one head share their kernel
          load_dynamic_block(wp + b * ws.v[0] + (c / d.G) * ws.v[1], ws.v[2], ws.v[3], K, T, wblock.data());
          cached = bh;
        }
        if (!input_grad) {
          load_padded(xin + b * xs.b + c * xs.c, xs.t, T, P, K - 1 - P, xp.data());
          correlate_dynamic(xp.data(), wblock.data(), K, T, acc.data());
          store(acc.data(), T, yp + b * ys.b + c * ys.c, ys.t);
        } else {   // scattered: gxp[t + k] += w[k, t] * g[t], grad_x = gxp[P : P + T]
          load_padded(xin + b * xs.b + c * xs.c, xs.t, T, 0, 0, acc.data());
          std::fill(xp.begin(), xp.end(), acc_t(0));
          scatter_dynamic(acc.data(), wblock.data(), K, T, xp.data());
          store(xp.data() + P, T, yp + b * ys.b + c * ys.c, ys.t);
        }
      }
    });
  });
  return out;
}

Tensor dynamicconv_forward(const Tensor& x, const Tensor& w, int64_t padding_l) {
  const Dims d = check_conv("dynamicconv_forward", x, "x", w, padding_l, true);
  return dynamicconv_apply(x, w, padding_l, false, d);
}

Tensor dynamicconv_backward_input(const Tensor& grad_y, const Tensor& w, int64_t padding_l) {
  const Dims d = check_conv("dynamicconv_backward_input", grad_y, "grad_y", w, padding_l, true);
  return dynamicconv_apply(grad_y, w, padding_l, true, d);
}

// grad_w[b,h,k,t] = sum_{c in h} grad_y[b,c,t] * x[b,c,t+k-P], and (with w) grad_x in the same
// pass; one task per (b, h) owns its kernel gradient.
std::tuple<Tensor, Tensor> dynamicconv_grads(const Tensor& grad_y_, const Tensor& x, const Tensor* w, int64_t P,
                                             const Dims& d) {
  const Tensor gy = like(grad_y_, x);
  Tensor grad_w = w ? at::empty_like(*w) : at::empty({d.B, d.H, d.K, d.T}, x.options());
  Tensor grad_x = w ? at::empty_like(gy) : Tensor();
  if (grad_w.numel() == 0) return {grad_x, grad_w};
  const bool cl = channels_last(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dynamicconv_grads", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t K = d.K, T = d.T;
    const scalar_t* gp = gy.const_data_ptr<scalar_t>();
    const scalar_t* xin = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w ? w->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* gwp = grad_w.mutable_data_ptr<scalar_t>();
    scalar_t* gxp = w ? grad_x.mutable_data_ptr<scalar_t>() : nullptr;
    const S3 s(x), gs(gy);
    const S3 os = w ? S3(grad_x) : s;
    const S4 gws(grad_w);
    const S4 ws = w ? S4(*w) : gws;
    if (cl) {   // tasks: (b, chunk of steps); each writes its steps of grad_w and grad_x
      const int64_t per_b = chunks(T);
      at::parallel_for(0, d.B * per_b, grain_for(kStepChunk * d.C * K * (w ? 2 : 1)), [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / per_b, t0 = (task % per_b) * kStepChunk, t1 = std::min(T, t0 + kStepChunk);
          cl_dynamic_weight_grad<scalar_t, acc_t>(gp, xin, s, gwp, gws.v, d, P, b, t0, t1);
          if (!w) continue;
          const scalar_t* wb = wp + b * ws.v[0];
          cl_correlate<scalar_t, acc_t>(gp, gs, gxp, os, d, K - 1 - P, b, t0, t1, [&](int64_t h, int64_t t, acc_t* c) {
            const scalar_t* wbh = wb + h * ws.v[1];
            for (int64_t k = 0; k < K; ++k) {
              const int64_t src = t + k - (K - 1 - P);
              c[k] = (src >= 0 && src < T) ? static_cast<acc_t>(wbh[(K - 1 - k) * ws.v[2] + src * ws.v[3]])
                                           : acc_t(0);
            }
          });
        }
      });
      return;
    }
    at::parallel_for(0, d.B * d.H, grain_for(d.G * T * K * (w ? 2 : 1)), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> xp(T + K - 1), g(T), gw(K * T), wblock(w ? K * T : 0), gxpad(w ? T + K - 1 : 0);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / d.H, h = bh % d.H;
        std::fill(gw.begin(), gw.end(), acc_t(0));
        if (w) load_dynamic_block(wp + b * ws.v[0] + h * ws.v[1], ws.v[2], ws.v[3], K, T, wblock.data());
        for (int64_t c = h * d.G; c < (h + 1) * d.G; ++c) {   // channels in order: a fixed sum
          load_padded(xin + b * s.b + c * s.c, s.t, T, P, K - 1 - P, xp.data());
          load_padded(gp + b * gs.b + c * gs.c, gs.t, T, 0, 0, g.data());
          for (int64_t k = 0; k < K; ++k) {
            acc_t* __restrict__ a = gw.data() + k * T;
            const acc_t* __restrict__ xv = xp.data() + k;
            const acc_t* __restrict__ gv = g.data();
            for (int64_t t = 0; t < T; ++t) a[t] += gv[t] * xv[t];
          }
          if (w) {
            std::fill(gxpad.begin(), gxpad.end(), acc_t(0));
            scatter_dynamic(g.data(), wblock.data(), K, T, gxpad.data());
            store(gxpad.data() + P, T, gxp + b * os.b + c * os.c, os.t);
          }
        }
        for (int64_t k = 0; k < K; ++k)
          store(gw.data() + k * T, T, gwp + b * gws.v[0] + h * gws.v[1] + k * gws.v[2], gws.v[3]);
      }
    });
  });
  return {grad_x, grad_w};
}

Tensor dynamicconv_backward_weight(const Tensor& grad_y, const Tensor& x, int64_t padding_l, int64_t heads,
                                   int64_t kernel_size) {
  const Dims d = check_weight_grad("dynamicconv_backward_weight", grad_y, x, padding_l, heads, kernel_size);
  return std::get<1>(dynamicconv_grads(grad_y, x, nullptr, padding_l, d));
}

std::tuple<Tensor, Tensor> dynamicconv_backward(const Tensor& grad_y, const Tensor& x, const Tensor& w,
                                                int64_t padding_l) {
  const Dims d = check_conv("dynamicconv_backward", x, "x", w, padding_l, true);
  check_weight_grad("dynamicconv_backward", grad_y, x, padding_l, d.H, d.K);
  return dynamicconv_grads(grad_y, x, &w, padding_l, d);
}

// ---------------------------------------------------------------------------------------------
// Incremental decoding: one causal output step from a ring buffer of the last K-1 inputs
// ---------------------------------------------------------------------------------------------

// y[b, c] = sum_{j < K-1} w[j] * buffer[(position + j) % (K-1), b, c] + w[K-1] * x[b, c], with
// w = weight[h] (LightConv, (H, K)) or weight[b, h] (DynamicConv, (B, H, K)). The buffer's
// oldest row is at ``position``; rows never written hold zeros (the causal zero padding).
Tensor conv_step(const char* op, const Tensor& buffer_, const Tensor& x_, const Tensor& weight_, int64_t position,
                 bool dynamic) {
  check_cpu_float(op, x_, "x");
  check_cpu_float(op, buffer_, "buffer");
  check_cpu_float(op, weight_, "weight");
  check_same_dtype(op, x_, "x", buffer_, "buffer");
  check_same_dtype(op, x_, "x", weight_, "weight");
  TORCH_CHECK_VALUE(x_.dim() == 2, op, ": x must be (B, C), got shape ", x_.sizes());
  const int64_t B = x_.size(0), C = x_.size(1);
  TORCH_CHECK_VALUE(weight_.dim() == (dynamic ? 3 : 2) && (!dynamic || weight_.size(0) == B), op, ": weight must be ",
                    dynamic ? "(B, H, K)" : "(H, K)", ", got shape ", weight_.sizes());
  const int64_t H = weight_.size(dynamic ? 1 : 0), K = weight_.size(dynamic ? 2 : 1);
  check_heads_padding(op, C, H, K, K - 1);
  TORCH_CHECK_VALUE(buffer_.dim() == 3 && buffer_.size(0) == K - 1 && buffer_.size(1) == B && buffer_.size(2) == C,
                    op, ": buffer must be (K-1, B, C) = (", K - 1, ", ", B, ", ", C, "), got ", buffer_.sizes());
  TORCH_CHECK_VALUE(K == 1 || (0 <= position && position < K - 1), op, ": position must be in [0, K-2] = [0, ",
                    K - 2, "], got ", position);
  const Tensor buffer = buffer_.contiguous(), x = x_.contiguous(), weight = weight_.contiguous();
  Tensor y = at::empty({B, C}, x.options());
  const int64_t G = C / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "conv_step", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* bp = buffer.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    const int64_t per_head = (G + kChannelBlock - 1) / kChannelBlock;
    const int64_t tasks = B * H * per_head;
    at::parallel_for(0, tasks, grain_for(K * kChannelBlock), [&](int64_t begin, int64_t end) {
      std::vector<const scalar_t*> rows(K);
      std::vector<acc_t> coef(K);
      acc_t out[kChannelBlock];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t bh = task / per_head, b = bh / H, h = bh % H;
        const int64_t c0 = h * G + (task % per_head) * kChannelBlock;
        const int64_t n = std::min(kChannelBlock, (h + 1) * G - c0);
        for (int64_t j = 0; j < K - 1; ++j) rows[j] = bp + (((position + j) % (K - 1)) * B + b) * C + c0;
        rows[K - 1] = xp + b * C + c0;
        const scalar_t* wh = wp + (dynamic ? b * H + h : h) * K;
        for (int64_t k = 0; k < K; ++k) coef[k] = static_cast<acc_t>(wh[k]);
        weighted_rows(rows.data(), coef.data(), K, n, out);
        store(out, n, yp + b * C + c0, 1);
      }
    });
  });
  return y;
}

Tensor lightconv_step(const Tensor& buffer, const Tensor& x, const Tensor& weight, int64_t position) {
  return conv_step("lightconv_step", buffer, x, weight, position, false);
}

Tensor dynamicconv_step(const Tensor& buffer, const Tensor& x, const Tensor& weight, int64_t position) {
  return conv_step("dynamicconv_step", buffer, x, weight, position, true);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_chimera native CPU lightweight / dynamic convolution (x: (B, C, T), any strides)";
  m.def("lightconv_forward", &lightconv_forward, "y = lightconv(x, w (H, K), padding_l)", py::arg("x"),
        py::arg("weight"), py::arg("padding_l"));
  m.def("lightconv_backward_input", &lightconv_backward_input, "grad_x from grad_y and w (H, K)",
        py::arg("grad_y"), py::arg("weight"), py::arg("padding_l"));
  m.def("lightconv_backward_weight", &lightconv_backward_weight, "grad_w (H, K) in x.dtype from grad_y and x",
        py::arg("grad_y"), py::arg("x"), py::arg("padding_l"), py::arg("heads"), py::arg("kernel_size"));
  m.def("lightconv_backward", &lightconv_backward, "(grad_x, grad_w) in one pass over grad_y and x",
        py::arg("grad_y"), py::arg("x"), py::arg("weight"), py::arg("padding_l"));
  m.def("dynamicconv_forward", &dynamicconv_forward, "y = dynamicconv(x, w (B, H, K, T), padding_l)",
        py::arg("x"), py::arg("weight"), py::arg("padding_l"));
  m.def("dynamicconv_backward_input", &dynamicconv_backward_input, "grad_x from grad_y and w (B, H, K, T)",
        py::arg("grad_y"), py::arg("weight"), py::arg("padding_l"));
  m.def("dynamicconv_backward_weight", &dynamicconv_backward_weight,
        "grad_w (B, H, K, T) in x.dtype from grad_y and x", py::arg("grad_y"), py::arg("x"), py::arg("padding_l"),
        py::arg("heads"), py::arg("kernel_size"));
  m.def("dynamicconv_backward", &dynamicconv_backward, "(grad_x, grad_w) in one pass over grad_y and x",
        py::arg("grad_y"), py::arg("x"), py::arg("weight"), py::arg("padding_l"));
  m.def("lightconv_step", &lightconv_step, "one causal decoding step from a (K-1, B, C) ring buffer",
        py::arg("buffer"), py::arg("x"), py::arg("weight"), py::arg("position"));
  m.def("dynamicconv_step", &dynamicconv_step, "one causal decoding step, per-batch kernels (B, H, K)",
        py::arg("buffer"), py::arg("x"), py::arg("weight"), py::arg("position"));
}
