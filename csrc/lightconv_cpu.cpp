// Native CPU lightweight and dynamic convolution (Wu et al. 2019): forward and both gradients.
//
// Same math, layout and checks as ds_chimera/ops/reference.py:
//   x (B, C, T); LightConv weight (H, K); DynamicConv weight (B, H, K, T); head h = c / (C / H);
//   y[b,c,t] = sum_k w[h,k] (or w[b,h,k,t]) * x[b,c,t+k-P], zero outside [0, T), P in [0, K-1].
//
// Every row is copied once into a zero-padded accumulator-typed buffer (fp32 for fp32/fp16/bf16,
// fp64 for fp64), so the inner loops are branch-free contiguous loops over t that the compiler
// vectorises ("for each k: out[t] += w_k * xp[t + k]"), and half/bf16 are converted only once per
// element. Work is split with at::parallel_for (OpenMP); every output element is written by
// one task only and summed in a fixed order, so results do not depend on the thread count.

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
// Row helpers
// ---------------------------------------------------------------------------------------------

// dst[0 : n + pad_l + pad_r] = [0]*pad_l ++ acc(src[0:n]) ++ [0]*pad_r
template <typename scalar_t, typename acc_t>
inline void load_padded(const scalar_t* src, int64_t n, int64_t pad_l, int64_t pad_r, acc_t* dst) {
  std::fill(dst, dst + pad_l, acc_t(0));
  for (int64_t i = 0; i < n; ++i) dst[pad_l + i] = static_cast<acc_t>(src[i]);
  std::fill(dst + pad_l + n, dst + pad_l + n + pad_r, acc_t(0));
}

// dst[0:n] = src[lo:lo+n] of a length-T row, zero where the index falls outside [0, T).
template <typename scalar_t, typename acc_t>
inline void load_window(const scalar_t* src, int64_t T, int64_t lo, int64_t n, acc_t* dst) {
  const int64_t a = std::min(n, std::max<int64_t>(0, -lo));          // leading zeros
  const int64_t e = std::max(a, std::min(n, T - lo));                // end of the copied part
  std::fill(dst, dst + a, acc_t(0));
  for (int64_t i = a; i < e; ++i) dst[i] = static_cast<acc_t>(src[lo + i]);
  std::fill(dst + e, dst + n, acc_t(0));
}

template <typename scalar_t, typename acc_t>
inline void store(const acc_t* src, int64_t n, scalar_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}

// Hands out an acc_t view of a block of scalars: the pointer itself when the types agree,
// otherwise a converted copy that is kept while consecutive calls ask for the same block
// (rows of one head share their dynamic kernel).
template <typename scalar_t, typename acc_t>
struct AccBlock {
  std::vector<acc_t> buf;
  const scalar_t* cached = nullptr;
  const acc_t* get(const scalar_t* p, int64_t n) {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      return p;
    } else {
      if (p != cached) {
        buf.resize(n);
        for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<acc_t>(p[i]);
        cached = p;
      }
      return buf.data();
    }
  }
};

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

// ---------------------------------------------------------------------------------------------
// LightConv
// ---------------------------------------------------------------------------------------------

// Shared by forward (w as is, pad P left) and backward_input (w flipped, pad K-1-P left):
// both are out[t] = sum_k w[k] * in[t + k - pad_l].
Tensor lightconv_rows(const Tensor& in_, const Tensor& w_, int64_t pad_l, bool flip, const Dims& d) {
  const Tensor in = in_.contiguous();
  const Tensor w = w_.contiguous();
  Tensor out = at::empty({d.B, d.C, d.T}, in.options());
  if (out.numel() == 0) return out;
  const int64_t rows = d.B * d.C, T = d.T, K = d.K, G = d.G, H = d.H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.scalar_type(), "lightconv_rows", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xin = in.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* yp = out.mutable_data_ptr<scalar_t>();
    std::vector<acc_t> wacc(H * K);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t k = 0; k < K; ++k)
        wacc[h * K + k] = static_cast<acc_t>(wp[h * K + (flip ? K - 1 - k : k)]);
    at::parallel_for(0, rows, grain_for(T * K), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> xp(T + K - 1);
      constexpr bool direct = std::is_same_v<scalar_t, acc_t>;
      std::vector<acc_t> acc(direct ? 0 : T);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t h = (r % d.C) / G;
        load_padded(xin + r * T, T, pad_l, K - 1 - pad_l, xp.data());
        // fp32/fp64 accumulate straight into y; half/bf16 through the fp32 row buffer
        acc_t* dst = direct ? reinterpret_cast<acc_t*>(yp + r * T) : acc.data();
        correlate_static(xp.data(), wacc.data() + h * K, K, T, dst);
        if (!direct) store(acc.data(), T, yp + r * T);
      }
    });
  });
  return out;
}

Tensor lightconv_forward(const Tensor& x, const Tensor& w, int64_t padding_l) {
  const Dims d = check_conv("lightconv_forward", x, "x", w, padding_l, false);
  return lightconv_rows(x, w, padding_l, false, d);
}

// grad_x[s] = sum_k w[k] * grad_y[s - k + P] = sum_k w[K-1-k] * grad_y[s + k - (K-1-P)]
Tensor lightconv_backward_input(const Tensor& grad_y, const Tensor& w, int64_t padding_l) {
  const Dims d = check_conv("lightconv_backward_input", grad_y, "grad_y", w, padding_l, false);
  return lightconv_rows(grad_y, w, d.K - 1 - padding_l, true, d);
}

// grad_w[h,k] = sum_{b, c in h, t} grad_y[b,c,t] * x[b,c,t+k-P]: one K-vector per (b, c) row in
// parallel, then a fixed-order reduction over the rows of each head.
Tensor lightconv_backward_weight(const Tensor& grad_y_, const Tensor& x_, int64_t padding_l, int64_t heads,
                                 int64_t kernel_size) {
  const Dims d = check_weight_grad("lightconv_backward_weight", grad_y_, x_, padding_l, heads, kernel_size);
  const Tensor gy = grad_y_.contiguous();
  const Tensor x = x_.contiguous();
  const int64_t rows = d.B * d.C, T = d.T, K = d.K, G = d.G, H = d.H, C = d.C;
  Tensor grad_w = at::empty({H, K}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "lightconv_backward_weight", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = gy.const_data_ptr<scalar_t>();
    const scalar_t* xin = x.const_data_ptr<scalar_t>();
    std::vector<acc_t> partial(rows * K, acc_t(0));
    if (T > 0) {
      at::parallel_for(0, rows, grain_for(T * K), [&](int64_t begin, int64_t end) {
        std::vector<acc_t> xp(T + K - 1);
        AccBlock<scalar_t, acc_t> g;
        for (int64_t r = begin; r < end; ++r) {
          load_padded(xin + r * T, T, padding_l, K - 1 - padding_l, xp.data());
          const acc_t* grow = g.get(gp + r * T, T);
          acc_t* pr = partial.data() + r * K;
          for (int64_t t0 = 0; t0 < T; t0 += kTimeBlock) {
            const int64_t n = std::min(kTimeBlock, T - t0);
            for (int64_t k = 0; k < K; ++k) pr[k] += dot(grow + t0, xp.data() + t0 + k, n);
          }
        }
      });
    }
    scalar_t* out = grad_w.mutable_data_ptr<scalar_t>();
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t k = 0; k < K; ++k) {
        acc_t s = 0;
        for (int64_t b = 0; b < d.B; ++b)
          for (int64_t g = 0; g < G; ++g) s += partial[(b * C + h * G + g) * K + k];
        out[h * K + k] = static_cast<scalar_t>(s);
      }
    }
  });
  return grad_w;
}

// ---------------------------------------------------------------------------------------------
// DynamicConv
// ---------------------------------------------------------------------------------------------

Tensor dynamicconv_forward(const Tensor& x_, const Tensor& w_, int64_t padding_l) {
  const Dims d = check_conv("dynamicconv_forward", x_, "x", w_, padding_l, true);
  const Tensor x = x_.contiguous();
  const Tensor w = w_.contiguous();
  Tensor y = at::empty({d.B, d.C, d.T}, x.options());
  if (y.numel() == 0) return y;
  const int64_t rows = d.B * d.C, T = d.T, K = d.K, G = d.G, C = d.C, H = d.H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dynamicconv_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xin = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(T * K), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> xp(T + K - 1);
      constexpr bool direct = std::is_same_v<scalar_t, acc_t>;
      std::vector<acc_t> acc(direct ? 0 : T);
      AccBlock<scalar_t, acc_t> wblock;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / C, h = (r % C) / G;
        const acc_t* wbh = wblock.get(wp + (b * H + h) * K * T, K * T);
        load_padded(xin + r * T, T, padding_l, K - 1 - padding_l, xp.data());
        acc_t* dst = direct ? reinterpret_cast<acc_t*>(yp + r * T) : acc.data();
        correlate_dynamic(xp.data(), wbh, K, T, dst);
        if (!direct) store(acc.data(), T, yp + r * T);
      }
    });
  });
  return y;
}

// grad_x[s] = sum_k w[b,h,k,t] * grad_y[t], t = s - k + P: scattered as gxp[t + k] += w_k[t] * g[t]
// into a padded accumulator, grad_x = gxp[P : P + T].
Tensor dynamicconv_backward_input(const Tensor& grad_y_, const Tensor& w_, int64_t padding_l) {
  const Dims d = check_conv("dynamicconv_backward_input", grad_y_, "grad_y", w_, padding_l, true);
  const Tensor gy = grad_y_.contiguous();
  const Tensor w = w_.contiguous();
  Tensor gx = at::empty({d.B, d.C, d.T}, gy.options());
  if (gx.numel() == 0) return gx;
  const int64_t rows = d.B * d.C, T = d.T, K = d.K, G = d.G, C = d.C, H = d.H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gy.scalar_type(), "dynamicconv_backward_input", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = gy.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* out = gx.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(T * K), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> gxp(T + K - 1);
      AccBlock<scalar_t, acc_t> wblock, grow;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / C, h = (r % C) / G;
        const acc_t* __restrict__ wbh = wblock.get(wp + (b * H + h) * K * T, K * T);
        const acc_t* __restrict__ g = grow.get(gp + r * T, T);
        acc_t* __restrict__ acc = gxp.data();
        std::fill(acc, acc + T + K - 1, acc_t(0));
        for (int64_t t0 = 0; t0 < T; t0 += kTimeBlock) {
          const int64_t n = std::min(kTimeBlock, T - t0);
          for (int64_t k = 0; k < K; ++k) {
            const acc_t* __restrict__ wk = wbh + k * T + t0;
            const acc_t* __restrict__ gs = g + t0;
            acc_t* __restrict__ o = acc + t0 + k;
            for (int64_t t = 0; t < n; ++t) o[t] += wk[t] * gs[t];
          }
        }
        store(acc + padding_l, T, out + r * T);
      }
    });
  });
  return gx;
}

// grad_w[b,h,k,t] = sum_{c in h} grad_y[b,c,t] * x[b,c,t+k-P]; tasks are (b, h, t-block), each
// owning a (K, block) accumulator and looping over the head's channels in order.
Tensor dynamicconv_backward_weight(const Tensor& grad_y_, const Tensor& x_, int64_t padding_l, int64_t heads,
                                   int64_t kernel_size) {
  const Dims d = check_weight_grad("dynamicconv_backward_weight", grad_y_, x_, padding_l, heads, kernel_size);
  const Tensor gy = grad_y_.contiguous();
  const Tensor x = x_.contiguous();
  const int64_t T = d.T, K = d.K, G = d.G, C = d.C, H = d.H;
  Tensor grad_w = at::empty({d.B, H, K, T}, x.options());
  if (grad_w.numel() == 0) return grad_w;
  const int64_t tb = std::min(T, std::max<int64_t>(64, 8192 / K));  // (K, tb) accumulator ~ L1
  const int64_t nblocks = (T + tb - 1) / tb;
  const int64_t tasks = d.B * H * nblocks;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dynamicconv_backward_weight", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = gy.const_data_ptr<scalar_t>();
    const scalar_t* xin = x.const_data_ptr<scalar_t>();
    scalar_t* out = grad_w.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, tasks, grain_for(G * tb * K), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(K * tb), xs(tb + K - 1), gs(tb);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t bh = task / nblocks, t0 = (task % nblocks) * tb;
        const int64_t b = bh / H, h = bh % H;
        const int64_t n = std::min(tb, T - t0);
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t g = 0; g < G; ++g) {
          const int64_t row = b * C + h * G + g;
          // xs[i] = x[t0 + i - P], i in [0, n + K - 1)
          load_window(xin + row * T, T, t0 - padding_l, n + K - 1, xs.data());
          load_window(gp + row * T, T, t0, n, gs.data());
          const acc_t* __restrict__ gv = gs.data();
          for (int64_t k = 0; k < K; ++k) {
            acc_t* __restrict__ a = acc.data() + k * tb;
            const acc_t* __restrict__ xv = xs.data() + k;
            for (int64_t t = 0; t < n; ++t) a[t] += gv[t] * xv[t];
          }
        }
        for (int64_t k = 0; k < K; ++k) store(acc.data() + k * tb, n, out + ((bh * K) + k) * T + t0);
      }
    });
  });
  return grad_w;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_chimera native CPU lightweight / dynamic convolution (x: (B, C, T))";
  m.def("lightconv_forward", &lightconv_forward, "y = lightconv(x, w (H, K), padding_l)", py::arg("x"),
        py::arg("weight"), py::arg("padding_l"));
  m.def("lightconv_backward_input", &lightconv_backward_input, "grad_x from grad_y and w (H, K)",
        py::arg("grad_y"), py::arg("weight"), py::arg("padding_l"));
  m.def("lightconv_backward_weight", &lightconv_backward_weight, "grad_w (H, K) in x.dtype from grad_y and x",
        py::arg("grad_y"), py::arg("x"), py::arg("padding_l"), py::arg("heads"), py::arg("kernel_size"));
  m.def("dynamicconv_forward", &dynamicconv_forward, "y = dynamicconv(x, w (B, H, K, T), padding_l)",
        py::arg("x"), py::arg("weight"), py::arg("padding_l"));
  m.def("dynamicconv_backward_input", &dynamicconv_backward_input, "grad_x from grad_y and w (B, H, K, T)",
        py::arg("grad_y"), py::arg("weight"), py::arg("padding_l"));
  m.def("dynamicconv_backward_weight", &dynamicconv_backward_weight,
        "grad_w (B, H, K, T) in x.dtype from grad_y and x", py::arg("grad_y"), py::arg("x"), py::arg("padding_l"),
        py::arg("heads"), py::arg("kernel_size"));
}
