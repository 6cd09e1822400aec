// F16 and BF16 weights (a GGUF's unquantized tensors) multiplied as stored, 2 bytes a weight,
// instead of dequantized to fp32 (4 bytes: one stream's decode, bound by reading the weights, ran
// at half llama.cpp's speed on an F16 file).
//
// Repacked once at load into tiles of 16 rows (half_repack): for each input k, the 16 rows' values
// side by side (32 bytes), so that one load and one widening give a vector of 16 weights, and one
// fma per activation row advances 16 outputs. Per output the products are summed in fp32 in the
// order k = 0, 1, ... (exact products of fp32 activations and widened weights), on every ISA path.
// Registered as torch.ops.pagoda.half_repack / half_gemm / half_gemm_isa; block_matmul takes a
// weight of type HALF_PACKED (1001) here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "huge_pages.h"
#include "ops.h"

namespace {

constexpr int64_t COLS = 16;
constexpr int64_t HEADER = 64;  // int64: magic, K, N, type (1 = F16, 30 = BF16)
constexpr int64_t MAGIC = 0x3146414850474150;  // "PAGPHAF1"
constexpr int64_t F16 = 1, BF16 = 30;           // GGMLQuantizationType values

struct Header {
  int64_t K, N, type;
  const uint16_t* data;
};

Header read_header(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() >= HEADER, "half_gemm: not a packed weight (a uint8 tensor from half_repack)");
  int64_t words[4];
  std::memcpy(words, packed.data_ptr<uint8_t>(), sizeof(words));
  const int64_t tiles = (words[2] + COLS - 1) / COLS;
  TORCH_CHECK(words[0] == MAGIC && (words[3] == F16 || words[3] == BF16) &&
                  packed.numel() == HEADER + tiles * words[1] * COLS * 2,
              "half_gemm: not a packed weight (bad header)");
  return {words[1], words[2], words[3], reinterpret_cast<const uint16_t*>(packed.data_ptr<uint8_t>() + HEADER)};
}

inline float widen(uint16_t v, int64_t type) {
  if (type == BF16) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  return c10::detail::fp16_ieee_to_fp32_value(v);
}

#if defined(__AVX512F__)
inline __m512 widen16(const uint16_t* p, int64_t type) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (type == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  return _mm512_cvtph_ps(v);
}

// R rows against one tile: acc[r] += x[r, k] * w[k, 16 rows] for k in order.
template <int R>
void tile_rows(const uint16_t* tile, int64_t type, int64_t K, const float* x, float* y, int64_t ldy, int64_t n0,
               int64_t N) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w = widen16(tile + k * COLS, type);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, acc[r]);
  }
  const __mmask16 mask = n0 + COLS <= N ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, mask, acc[r]);
}
#endif

// Lane by lane: the same products in the same order, std::fma as the vector fma rounds.
template <int R>
void tile_rows_scalar(const uint16_t* tile, int64_t type, int64_t K, const float* x, float* y, int64_t ldy,
                      int64_t n0, int64_t N) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < COLS && n0 + c < N; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[r * K + k], widen(tile[k * COLS + c], type), acc);
      y[r * ldy + n0 + c] = acc;
    }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PAGODA_HALF_AVX2 1
#include <immintrin.h>

inline __m256 widen8(const uint16_t* p, int64_t type) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (type == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  return _mm256_cvtph_ps(v);
}

// As tile_rows, a tile's 16 outputs as two vectors of 8.
template <int R>
void tile_rows_avx2(const uint16_t* tile, int64_t type, int64_t K, const float* x, float* y, int64_t ldy,
                    int64_t n0, int64_t N) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = widen8(tile + k * COLS, type), w1 = widen8(tile + k * COLS + 8, type);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * K + k]);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, acc[r][0]);
    _mm256_store_ps(lanes + 8, acc[r][1]);
    for (int64_t c = 0; c < COLS && n0 + c < N; ++c) y[r * ldy + n0 + c] = lanes[c];
  }
}
#endif

template <int R>
void rows(const uint16_t* tile, int64_t type, int64_t K, const float* x, float* y, int64_t ldy, int64_t n0,
          int64_t N) {
#if defined(__AVX512F__)
  tile_rows<R>(tile, type, K, x, y, ldy, n0, N);
#elif defined(PAGODA_HALF_AVX2)
  tile_rows_avx2<R>(tile, type, K, x, y, ldy, n0, N);
#else
  tile_rows_scalar<R>(tile, type, K, x, y, ldy, n0, N);
#endif
}

const char* isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(PAGODA_HALF_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

namespace pagoda {

// weight: [N, K] as stored (uint16 bits of fp16 / bf16, viewed as int16 or uint8 pairs) → tiles.
at::Tensor half_repack(const at::Tensor& weight, int64_t type) {
  TORCH_CHECK(type == F16 || type == BF16, "half_repack: type ", type, " is not F16 (1) or BF16 (30)");
  TORCH_CHECK(weight.dim() == 2 && weight.element_size() == 2, "half_repack: weight must be 2-byte values [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + COLS - 1) / COLS;
  at::Tensor out = huge_page_zeros(HEADER + tiles * K * COLS * 2);
  const int64_t words[4] = {MAGIC, K, N, type};
  std::memcpy(out.data_ptr<uint8_t>(), words, sizeof(words));
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<uint8_t>() + HEADER);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < COLS && t * COLS + c < N; ++c)
        for (int64_t k = 0; k < K; ++k) dst[(t * K + k) * COLS + c] = src[(t * COLS + c) * K + k];
  });
  return out;
}

at::Tensor half_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "half_gemm: x must be float32 [M, K]");
  const Header h = read_header(packed);
  TORCH_CHECK(x.size(1) == h.K, "half_gemm: x has ", x.size(1), " features, the weight takes ", h.K);
  TORCH_CHECK(out_features == h.N, "half_gemm: the weight has ", h.N, " outputs, not ", out_features);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), tiles = (h.N + COLS - 1) / COLS;
  at::Tensor out = at::empty({M, h.N}, x.options());
  const float* xs = xc.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* tile = h.data + t * h.K * COLS;
      for (int64_t m = 0; m < M; m += 4) {
        const float* xm = xs + m * h.K;
        float* ym = y + m * h.N;
        switch (std::min<int64_t>(4, M - m)) {
          case 4: rows<4>(tile, h.type, h.K, xm, ym, h.N, t * COLS, h.N); break;
          case 3: rows<3>(tile, h.type, h.K, xm, ym, h.N, t * COLS, h.N); break;
          case 2: rows<2>(tile, h.type, h.K, xm, ym, h.N, t * COLS, h.N); break;
          default: rows<1>(tile, h.type, h.K, xm, ym, h.N, t * COLS, h.N);
        }
      }
    }
  });
  return out;
}

at::Tensor half_gemm_packed(const at::Tensor& x, const at::Tensor& packed) {
  return half_gemm(x, packed, read_header(packed).N);
}

// Rows `ids` of the packed weight as float32 [len(ids), K] (a tied embedding's lookup).
at::Tensor half_rows(const at::Tensor& packed, const at::Tensor& ids) {
  const Header h = read_header(packed);
  const at::Tensor index = ids.to(at::kLong).contiguous().view({-1});
  at::Tensor out = at::empty({index.numel(), h.K}, at::kFloat);
  const int64_t* id = index.data_ptr<int64_t>();
  float* y = out.data_ptr<float>();
  for (int64_t i = 0; i < index.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < h.N, "half_rows: row ", id[i], " is out of range for ", h.N, " rows");
    const uint16_t* tile = h.data + id[i] / COLS * h.K * COLS;
    for (int64_t k = 0; k < h.K; ++k) y[i * h.K + k] = widen(tile[k * COLS + id[i] % COLS], h.type);
  }
  return out;
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("half_repack(Tensor weight, int type) -> Tensor");
  m.def("half_gemm(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("half_rows(Tensor packed, Tensor ids) -> Tensor");
  m.def("half_gemm_isa() -> str", []() { return std::string(isa()); });
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("half_repack", &pagoda::half_repack);
  m.impl("half_gemm", &pagoda::half_gemm);
  m.impl("half_rows", &pagoda::half_rows);
}
