// The kept mass of each row's top-p nucleus (with min-p), without sorting.
//
// A token is in the nucleus when the probability mass of the tokens strictly
// more likely than it is below top_p (the rule the sampler's draw tests), so
// the nucleus is every token at or above a threshold value. Finding it with
// PyTorch takes a topk that widens until each row's nucleus closes: thousands
// of tokens in a flat row, and a sort each time. This finds the threshold by
// the bits of the floats instead: a non-negative float's bit pattern orders
// like its value, so a histogram of the probability mass over the top bits
// (bits 29..20), then over the next ten bits of the one bucket the threshold
// falls in, then over the last ten (where each bucket is one exact value),
// walks down from the most likely value to the threshold in three passes over
// the row. Masses add up in double.
//
// Built with decode_attention.cpp by twinkle_torch.native; see that module.

#include <cstdint>
#include <cstring>
#include <limits>

#include <omp.h>

namespace {

constexpr int kBuckets = 1024;  // ten bits a level
constexpr uint32_t kTooBig = 0x40000000u;  // 2.0f: a probability is below it (and not negative, NaN or inf)

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float value_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

struct Walk {
  const float* p;
  int64_t n;
  double top_p;
  double above = 0.0;    // mass of the values kept so far (all strictly above what comes next)
  uint32_t lowest = 0;   // bits of the lowest value kept so far, once the walk reaches exact values
  bool reached = false;  // the mass above reached top_p: the threshold is found
};

// Mass per bucket of one level. Level 0 takes bits 29..20 of every value;
// level 1 bits 19..10 of the values whose bits 29..20 are `prefix`; level 2
// bits 9..0 of those whose bits 29..10 are `prefix`. Level 0 returns false
// for a row holding a value that is not a probability.
bool histogram(const Walk& w, int level, uint32_t prefix, double* h) {
  std::memset(h, 0, sizeof(double) * kBuckets);
  if (level == 0) {
    // four histograms, a quarter of the elements each, so runs of one bucket do not wait on each other's stores
    double part[3][kBuckets] = {};
    uint32_t bad = 0;
    int64_t i = 0;
    for (; i + 3 < w.n; i += 4) {
      const uint32_t a = bits_of(w.p[i]), b = bits_of(w.p[i + 1]), c = bits_of(w.p[i + 2]), d = bits_of(w.p[i + 3]);
      bad |= a | b | c | d;
      h[(a >> 20) & (kBuckets - 1)] += w.p[i];
      part[0][(b >> 20) & (kBuckets - 1)] += w.p[i + 1];
      part[1][(c >> 20) & (kBuckets - 1)] += w.p[i + 2];
      part[2][(d >> 20) & (kBuckets - 1)] += w.p[i + 3];
    }
    for (; i < w.n; ++i) {
      const uint32_t a = bits_of(w.p[i]);
      bad |= a;
      h[(a >> 20) & (kBuckets - 1)] += w.p[i];
    }
    for (int b = 0; b < kBuckets; ++b) h[b] += part[0][b] + part[1][b] + part[2][b];
    return bad < kTooBig;
  }
  const int shift = level == 1 ? 20 : 10;
  const int low = level == 1 ? 10 : 0;
  for (int64_t i = 0; i < w.n; ++i) {
    const uint32_t u = bits_of(w.p[i]);
    if ((u >> shift) == prefix) h[(u >> low) & (kBuckets - 1)] += w.p[i];
  }
  return true;
}

// Walk one level's buckets from the most likely down, refining the bucket the
// threshold falls in. Sets w.reached once the mass above the next value is
// top_p or more.
void walk(Walk& w, int level, uint32_t prefix, const double* h) {
  for (int b = kBuckets - 1; b >= 0 && !w.reached; --b) {
    if (h[b] == 0.0) continue;  // empty, or zeros only: they add nothing
    if (w.above >= w.top_p) {
      w.reached = true;
      return;
    }
    const uint32_t key = (prefix << 10) | static_cast<uint32_t>(b);
    if (level == 2) {  // one exact value: it is kept, all of its ties with it
      w.above += h[b];
      w.lowest = key;
    } else if (w.above + h[b] < w.top_p) {  // even its lowest value has less than top_p above it
      w.above += h[b];
    } else {
      double finer[kBuckets];
      histogram(w, level + 1, key, finer);
      walk(w, level + 1, key, finer);
    }
  }
  if (level == 0 && !w.reached && w.above >= w.top_p) w.reached = true;
}

float row_peak(const float* p, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = p[i] > top ? p[i] : top;
  return top;
}

// Mass and lowest value of the tokens at or above `floor`.
void at_or_above(const float* p, int64_t n, float floor, double* mass, float* lowest) {
  double sum = 0.0;
  float low = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] >= floor) {
      sum += p[i];
      low = p[i] < low ? p[i] : low;
    }
  }
  *mass = sum;
  *lowest = low;
}

}  // namespace

// probs: rows x vocab float32, each row's values contiguous, rows `row_stride`
// elements apart. For each row, `mass` gets the nucleus's total probability
// and `threshold` its lowest value (the nucleus is every token >= threshold);
// both NaN for a row holding a value that is not a probability. min_p < 0: no
// min-p rule. Returns 0, or -1 for arguments it does not take.
extern "C" int twinkle_nucleus(const float* probs, int64_t rows, int64_t vocab, int64_t row_stride, double top_p,
                               double min_p, float* mass, float* threshold, int threads) {
  if (rows < 0 || vocab < 1 || row_stride < vocab || threads < 1 || !(top_p > 0.0) || !(min_p <= 1.0)) return -1;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    Walk w{probs + r * row_stride, vocab, top_p};
    double h[kBuckets];
    if (!histogram(w, 0, 0, h)) {
      mass[r] = threshold[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    walk(w, 0, 0, h);
    double kept = w.above;
    float lowest = value_of(w.lowest);
    if (!w.reached) {  // the whole row is under top_p (rounding, or top_p near 1): every nonzero token is kept
      at_or_above(w.p, w.n, std::numeric_limits<float>::denorm_min(), &kept, &lowest);
    }
    if (min_p >= 0.0) {
      const float floor = static_cast<float>(min_p) * row_peak(w.p, w.n);
      if (floor > lowest) at_or_above(w.p, w.n, floor, &kept, &lowest);
    }
    mass[r] = static_cast<float>(kept);
    threshold[r] = lowest;
  }
  return 0;
}
