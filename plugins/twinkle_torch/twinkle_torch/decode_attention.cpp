// One decode step of grouped-query attention on CPU: every row of the batch has
// one new query token per head, attending over its cached keys and values.
//
// PyTorch's scaled_dot_product_attention runs this as many tiny matrix products
// (a group's few query heads against one key head) and is bound by their
// overhead, not by reading the cache. This kernel takes one (row, key head) per
// task and streams that head's keys once (the group's query heads scored
// together), then its values once, with the softmax in between held in a small
// buffer: close to the time it takes to read the cache.
//
// Built by twinkle_torch.native with the machine's C++ compiler (-O3
// -march=native -fopenmp) and called through ctypes with tensor pointers and
// strides; see that module for the layout it expects.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <omp.h>

namespace {

struct BF16 {
  uint16_t bits;
};

inline float load(float x) { return x; }
inline float load(BF16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* out, float x) { *out = x; }
inline void store(BF16* out, float x) {  // round to nearest even; a NaN stays a NaN
  uint32_t u;
  std::memcpy(&u, &x, 4);
  out->bits = x != x ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// exp(x) for x <= 0, written so the compiler vectorises it (no libm call):
// 2^n * p(r) with r = x - n ln 2, p a degree-7 polynomial; about 1e-7 relative.
// Below -87 (and for -inf, a masked position) it is exactly 0.
inline float exp_nonpositive(float x) {
  const bool under = x < -87.f;
  x = under ? -87.f : x;
  const float shifted = x * 1.44269504088896341f + 12582912.f;  // round(x / ln 2) in the low bits
  const float n = shifted - 12582912.f;
  int32_t n_bits;
  std::memcpy(&n_bits, &shifted, 4);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t scale_bits = (n_bits - 0x4B400000 + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, 4);
  return under ? 0.f : p * scale;
}

struct Shape {
  int64_t rows, heads, group, dim, length;
  int64_t q_row;                     // query: [rows, heads, group, dim], rows strided, the rest dense
  int64_t k_row, k_head, k_token;    // keys: [rows, heads, length, dim], dim dense
  int64_t v_row, v_head, v_token;    // values: the same
  int64_t m_row;                     // mask: [rows, length] bytes, nonzero = attend; or none
  float scale;
};

// One (row, key head): its `group` query heads against `length` cached tokens.
// G and D are the group and head size when known at compile time (0: take them
// from the shape). `scores` holds group * length floats, `work` 2 * group * dim.
template <typename T, int G, int D>
void one_head(const T* q, const T* k, const T* v, const uint8_t* mask, T* out, const Shape& s, float* scores,
              float* work) {
  const int64_t group = G ? G : s.group, dim = D ? D : s.dim, length = s.length;
  float q_local[G ? G * D : 1], acc_local[G ? G * D : 1];
  float* qs = G ? q_local : work;
  float* acc = G ? acc_local : work + group * dim;
  for (int64_t i = 0; i < group * dim; ++i) qs[i] = load(q[i]) * s.scale;

  for (int64_t t = 0; t < length; ++t) {  // scores, one key row read once for the whole group
    if (mask && !mask[t]) {
      for (int64_t g = 0; g < group; ++g) scores[g * length + t] = -INFINITY;
      continue;
    }
    const T* key = k + t * s.k_token;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qs + g * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < dim; ++i) dot += qg[i] * load(key[i]);
      scores[g * length + t] = dot;
    }
  }

  float inverse_sum[G ? G : 64];
  for (int64_t g = 0; g < group; ++g) {  // softmax, in place
    float* sg = scores + g * length;
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < length; ++t) top = sg[t] > top ? sg[t] : top;
    if (top == -INFINITY) {  // nothing to attend to: a zero output, never NaN
      std::memset(sg, 0, sizeof(float) * length);
      inverse_sum[g] = 0.f;
      continue;
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < length; ++t) {
      const float e = exp_nonpositive(sg[t] - top);
      sg[t] = e;
      sum += e;
    }
    inverse_sum[g] = 1.f / sum;
  }

  std::memset(acc, 0, sizeof(float) * group * dim);
  for (int64_t t = 0; t < length; ++t) {  // the weighted sum, one value row read once for the whole group
    if (mask && !mask[t]) continue;
    const T* value = v + t * s.v_token;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * length + t];
      float* ag = acc + g * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) ag[i] += p * load(value[i]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < dim; ++i) store(out + g * dim + i, acc[g * dim + i] * inverse_sum[g]);
}

template <typename T, int G, int D>
void run(const T* q, const T* k, const T* v, const uint8_t* mask, T* out, const Shape& s, int threads,
         float* scratch) {
  const int64_t tasks = s.rows * s.heads, per_thread = s.group * s.length + 2 * s.group * s.dim;
#pragma omp parallel num_threads(threads)
  {
    float* mine = scratch + omp_get_thread_num() * per_thread;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / s.heads, h = task % s.heads;
      one_head<T, G, D>(q + b * s.q_row + h * s.group * s.dim, k + b * s.k_row + h * s.k_head,
                        v + b * s.v_row + h * s.v_head, mask ? mask + b * s.m_row : nullptr,
                        out + task * s.group * s.dim, s, mine, mine + s.group * s.length);
    }
  }
}

template <typename T, int D>
void by_group(const T* q, const T* k, const T* v, const uint8_t* m, T* o, const Shape& s, int threads, float* w) {
  switch (s.group) {
    case 1: return run<T, 1, D>(q, k, v, m, o, s, threads, w);
    case 2: return run<T, 2, D>(q, k, v, m, o, s, threads, w);
    case 3: return run<T, 3, D>(q, k, v, m, o, s, threads, w);
    case 4: return run<T, 4, D>(q, k, v, m, o, s, threads, w);
    case 5: return run<T, 5, D>(q, k, v, m, o, s, threads, w);
    case 6: return run<T, 6, D>(q, k, v, m, o, s, threads, w);
    case 7: return run<T, 7, D>(q, k, v, m, o, s, threads, w);
    case 8: return run<T, 8, D>(q, k, v, m, o, s, threads, w);
    default: return run<T, 0, 0>(q, k, v, m, o, s, threads, w);
  }
}

template <typename T>
void dispatch(const void* q, const void* k, const void* v, const uint8_t* m, void* o, const Shape& s, int threads,
              float* w) {
  auto qt = static_cast<const T*>(q), kt = static_cast<const T*>(k), vt = static_cast<const T*>(v);
  auto ot = static_cast<T*>(o);
  if (s.dim == 64) return by_group<T, 64>(qt, kt, vt, m, ot, s, threads, w);
  if (s.dim == 128) return by_group<T, 128>(qt, kt, vt, m, ot, s, threads, w);
  return run<T, 0, 0>(qt, kt, vt, m, ot, s, threads, w);
}

}  // namespace

// dtype: 0 float32, 1 bfloat16. Strides are in elements. Returns 0, or -1 for
// an argument the kernel does not take (the caller falls back to PyTorch), -2
// when its scratch memory cannot be had.
extern "C" int twinkle_decode_attention(int dtype, const void* q, const void* k, const void* v, const uint8_t* mask,
                                        void* out, int64_t rows, int64_t heads, int64_t group, int64_t dim,
                                        int64_t length, int64_t q_row, int64_t k_row, int64_t k_head,
                                        int64_t k_token, int64_t v_row, int64_t v_head, int64_t v_token,
                                        int64_t m_row, float scale, int threads) {
  if (rows < 0 || heads < 1 || group < 1 || group > 64 || dim < 1 || length < 1 || threads < 1) return -1;
  const Shape s{rows, heads, group, dim, length, q_row, k_row, k_head, k_token, v_row, v_head, v_token, m_row, scale};
  if (dtype != 0 && dtype != 1) return -1;
  // per thread: the group's scores, its scaled queries and its sums
  float* scratch = static_cast<float*>(std::malloc(sizeof(float) * threads * (group * length + 2 * group * dim)));
  if (scratch == nullptr) return -2;
  if (dtype == 0) {
    dispatch<float>(q, k, v, mask, out, s, threads, scratch);
  } else {
    dispatch<BF16>(q, k, v, mask, out, s, threads, scratch);
  }
  std::free(scratch);
  return 0;
}
