// Weights in ggml's super-block formats (Q4_K, Q5_K, Q6_K, IQ4_XS, IQ4_NL), repacked once at load
// into tiles (superblock_formats.h) and multiplied by superblock_kernels.h.
//
// A packed weight is one uint8 tensor: a 256-byte header, then each part's tiles. A part is a run
// of output rows in one type: a merged projection whose shards differ in type (a Q4_K_M file's
// attn_q / attn_k in Q4_K beside its attn_v in Q6_K) is one weight of several parts.
//   header (int64): MAGIC, in_features K, out_features N, parts, then (type, rows) per part
// The activations are quantized once for all parts (int8 per block of 32, ggml_blocks.h).
//
// Registered as torch.ops.pagoda.superblock_repack / superblock_gemm / silu_mul_superblock_gemm /
// superblock_rows / superblock_isa / superblock_bf16_rows; block_matmul takes a weight of type
// PACKED (1000) here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "huge_pages.h"
#include "ops.h"
#include "superblock_amx.h"
#include "superblock_amx_bf16.h"
#include "superblock_kernels.h"
#include "work_items.h"

namespace {

using namespace pagoda::superblock;
using pagoda::ggml::QuantizedActivations;

constexpr int64_t MAGIC = 0x3154425347415050;  // "PPAGSBT1"
constexpr int64_t HEADER_BYTES = 256;
constexpr int64_t MAX_PARTS = (HEADER_BYTES / 8 - 4) / 2;
constexpr int64_t ROW_BLOCK = 64;         // activation rows a work item takes (their codes stay in L2)
#if defined(PAGODA_AVX512_VNNI)
constexpr int64_t GROUP = 2;  // tiles a kernel call takes (32 outputs)
// ... for one row (a stream's decode): each tile a stream of reads, and more streams at once
// read faster (a 1B model's projections on the AVX-512 EPYC, one thread: 2 tiles 15.7 GB/s,
// 4 tiles 17-20, against 26 for one plain sequential read; 8 tiles spill registers)
constexpr int64_t WIDE_GROUP = 4;
#else
constexpr int64_t GROUP = 1;
constexpr int64_t WIDE_GROUP = 1;
#endif

struct Part {
  int64_t type, rows, col, tiles, supers, tile_bytes;
  const uint8_t* data;
};

struct Header {
  int64_t K = 0, N = 0;
  std::vector<Part> parts;
};

int64_t part_bytes(int64_t type, int64_t rows, int64_t K) {
  return (rows + COLS - 1) / COLS * (K / super_elements(type)) * record_bytes(type);
}

Header read_header(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() >= HEADER_BYTES,
              "superblock: not a packed weight (a contiguous uint8 tensor from superblock_repack)");
  const uint8_t* base = packed.data_ptr<uint8_t>();
  int64_t words[HEADER_BYTES / 8];
  std::memcpy(words, base, HEADER_BYTES);
  TORCH_CHECK(words[0] == MAGIC && words[3] > 0 && words[3] <= MAX_PARTS, "superblock: not a packed weight (bad header)");
  Header h;
  h.K = words[1];
  h.N = words[2];
  int64_t offset = HEADER_BYTES, col = 0;
  for (int64_t p = 0; p < words[3]; ++p) {
    const int64_t type = words[4 + 2 * p], rows = words[5 + 2 * p];
    TORCH_CHECK(is_type(type) && rows > 0 && h.K % super_elements(type) == 0, "superblock: bad part in the header");
    const int64_t tiles = (rows + COLS - 1) / COLS, supers = h.K / super_elements(type);
    h.parts.push_back({type, rows, col, tiles, supers, supers * record_bytes(type), base + offset});
    offset += part_bytes(type, rows, h.K);
    col += rows;
  }
  TORCH_CHECK(col == h.N && offset == packed.numel(), "superblock: the header does not match the tensor's size");
  return h;
}

// ---- the GEMM ----------------------------------------------------------------------------------

template <int64_t T, int R>
void rows_against_group(const Part& p, int64_t first, int64_t count, const Rows& x, float* y, int64_t ldy) {
  const uint8_t* tiles = p.data + first * p.tile_bytes;
  const int64_t n0 = first * COLS;
#if defined(PAGODA_AVX512_VNNI)
  if constexpr (R == 1) {
    if (count == 4) return gemm_avx512<T, R, 4>(tiles, p.tile_bytes, p.supers, x, y, ldy, p.rows, n0);
    if (count == 3) return gemm_avx512<T, R, 3>(tiles, p.tile_bytes, p.supers, x, y, ldy, p.rows, n0);
  }
  if (count >= 2) {
    gemm_avx512<T, R, 2>(tiles, p.tile_bytes, p.supers, x, y, ldy, p.rows, n0);
    if (count > 2) rows_against_group<T, R>(p, first + 2, count - 2, x, y, ldy);
    return;
  }
  gemm_avx512<T, R, 1>(tiles, p.tile_bytes, p.supers, x, y, ldy, p.rows, n0);
#elif defined(PAGODA_AVX2)
  (void)count;
  gemm_avx2_half<T, R>(tiles, p.supers, x, y, ldy, p.rows, n0, 0);
  if (n0 + 8 < p.rows) gemm_avx2_half<T, R>(tiles, p.supers, x, y, ldy, p.rows, n0, 1);
#else
  (void)count;
  gemm_scalar<T>(tiles, p.supers, x, R, y, ldy, p.rows, n0);
#endif
}

#if defined(PAGODA_AMX_INT8)
// From this many rows of a work item on, the AMX tiles (superblock_amx.h) take the super-block
// formats' (Q4_K, Q5_K, Q6_K, IQ4_XS) products (under deterministic inference: outside it the bf16
// route takes these row counts). Below it, and for the blocks of 32 that have one scale a block
// and no more, the AVX-512 path is as fast or faster (benchmarks/README.md, "A Sapphire Rapids
// with AMX").
constexpr int64_t AMX_MIN_ROWS = 32;
#endif

template <int64_t T>
void rows_of_group(const Part& p, int64_t first, int64_t count, const Rows& all, int64_t m0, int64_t m1, float* y,
                   int64_t ldy) {
#if defined(PAGODA_AMX_INT8)
  if constexpr (is_k_quant(T)) {
    if (all.blocked != nullptr && m1 - m0 >= AMX_MIN_ROWS)
      return amx_rows_of_tiles<T>(p.data + first * p.tile_bytes, p.tile_bytes, p.supers, count, all, m0, m1,
                                  y + p.col, ldy, p.rows, first * COLS);
  }
#endif
  for (int64_t m = m0; m < m1; m += 4) {
    const Rows x = all.from(m);
    float* ym = y + m * ldy + p.col;
    switch (std::min<int64_t>(4, m1 - m)) {
      case 4: rows_against_group<T, 4>(p, first, count, x, ym, ldy); break;
      case 3: rows_against_group<T, 3>(p, first, count, x, ym, ldy); break;
      case 2: rows_against_group<T, 2>(p, first, count, x, ym, ldy); break;
      default: rows_against_group<T, 1>(p, first, count, x, ym, ldy);
    }
  }
}

// f(std::integral_constant<int64_t, type>) for a part's type.
template <typename F>
void with_type(int64_t type, const F& f) {
  switch (type) {
    case Q4_0: return f(std::integral_constant<int64_t, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int64_t, Q4_1>{});
    case Q5_0: return f(std::integral_constant<int64_t, Q5_0>{});
    case Q5_1: return f(std::integral_constant<int64_t, Q5_1>{});
    case Q8_0: return f(std::integral_constant<int64_t, Q8_0>{});
    case Q4_K: return f(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return f(std::integral_constant<int64_t, Q5_K>{});
    case Q6_K: return f(std::integral_constant<int64_t, Q6_K>{});
    case IQ4_XS: return f(std::integral_constant<int64_t, IQ4_XS>{});
    default: return f(std::integral_constant<int64_t, IQ4_NL>{});
  }
}

// work(part, first tile, tiles, m0, m1) for every part's tile groups against all M rows
// (work_items.h hands them to the threads).
template <typename Work>
void for_work_items(const Header& h, int64_t M, int64_t row_block, int64_t group, const Work& work) {
  for (const Part& p : h.parts)
    pagoda::for_work_items(M, row_block, (p.tiles + group - 1) / group, [&](int64_t g, int64_t m0, int64_t m1) {
      work(p, g * group, std::min(group, p.tiles - g * group), m0, m1);
    });
}

void product(const Header& h, const Rows& x, int64_t M, float* y) {
  for_work_items(h, M, ROW_BLOCK, M == 1 ? WIDE_GROUP : GROUP,
                 [&](const Part& p, int64_t first, int64_t count, int64_t m0, int64_t m1) {
                   with_type(p.type, [&](auto t) {
                     rows_of_group<decltype(t)::value>(p, first, count, x, m0, m1, y, h.N);
                   });
                 });
}

#if defined(PAGODA_AMX_BF16)
// The bf16 route (superblock_amx_bf16.h): from this many rows, outside deterministic inference.
constexpr int64_t BF16_MIN_ROWS = 32;
constexpr int64_t BF16_ROW_BLOCK = 256;  // rows a work item takes: its tiles are dequantized once for them

void bf16_product(const Header& h, const at::Tensor& x, int64_t M, float* y) {
  const at::Tensor blocked = blocked_bf16(x.data_ptr<float>(), M, h.K);
  const uint16_t* a = reinterpret_cast<const uint16_t*>(blocked.data_ptr<at::BFloat16>());
  for_work_items(h, M, BF16_ROW_BLOCK, 2, [&](const Part& p, int64_t first, int64_t count, int64_t m0, int64_t m1) {
    with_type(p.type, [&](auto t) {
      bf16_rows_of_tiles<decltype(t)::value>(p.data + first * p.tile_bytes, p.tile_bytes, p.supers, count, a, M,
                                             m0, m1, y + p.col, h.N, p.rows, first * COLS);
    });
  });
}
#endif

// The instruction set this build's superblock kernels run on (AVX-VNNI builds take the AVX2 path).
const char* isa() {
#if defined(PAGODA_AMX_INT8)
  return amx_usable() ? "amx-int8" : "avx512-vnni";
#elif defined(PAGODA_AVX512_VNNI)
  return "avx512-vnni";
#elif defined(PAGODA_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

bool has_k_quant(const Header& h) {
  for (const Part& p : h.parts)
    if (is_k_quant(p.type)) return true;
  return false;
}

bool has_q6_k(const Header& h) {
  for (const Part& p : h.parts)
    if (p.type == Q6_K) return true;
  return false;
}

// `floats()`: the activations as float32 [M, K] (the bf16 route's input).
template <typename Quantize, typename Floats>
at::Tensor gemm(const at::Tensor& rows, int64_t K, const at::Tensor& packed, const Quantize& quantize,
                const Floats& floats) {
  const Header h = read_header(packed);
  TORCH_CHECK(K == h.K, "superblock_gemm: x has ", K, " features, the weight takes ", h.K);
  const int64_t M = rows.size(0), nb = K / BLOCK;
  at::Tensor out = at::empty({M, h.N}, rows.options());
  if (M == 0) return out;
  const at::Tensor xc = rows.contiguous();
#if defined(PAGODA_AMX_BF16)
  if (M >= BF16_MIN_ROWS && !pagoda::batch_invariant() && amx_usable()) {
    bf16_product(h, floats(xc).contiguous(), M, out.data_ptr<float>());
    return out;
  }
#endif
  const QuantizedActivations a = quantize(xc.data_ptr<float>(), M, K);
  std::vector<int32_t> low;  // Q6_K scales each 16: the sum of a block's first 16 codes
  if (has_q6_k(h)) {
    low.resize(M * nb);
    at::parallel_for(0, M * nb, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        int32_t s = 0;
        for (int k = 0; k < 16; ++k) s += a.q[i * BLOCK + k];
        low[i] = s;
      }
    });
  }
  Rows x{a.q.data(), a.d.data(), a.s.data(), a.sum.data(), low.empty() ? nullptr : low.data(), K, nb};
  at::Tensor blocked;
#if defined(PAGODA_AMX_INT8)
  // the AMX tiles read a block's rows as one run (K bytes apart they fall in one or two cache sets)
  if (M >= AMX_MIN_ROWS && amx_usable() && has_k_quant(h)) {
    blocked = at::empty({M * K}, at::kChar);  // every byte copied below
    int8_t* codes = blocked.data_ptr<int8_t>();
    at::parallel_for(0, nb, 16, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        for (int64_t m = 0; m < M; ++m) std::memcpy(codes + (b * M + m) * BLOCK, &a.q[m * K + b * BLOCK], BLOCK);
    });
    x.blocked = codes;
    x.block_stride = M * BLOCK;
  }
#endif
  product(h, x, M, out.data_ptr<float>());
  return out;
}

}  // namespace

namespace pagoda {

// Row-parts of GGUF blocks (uint8 [rows, bytes], each of its type) → one packed weight.
at::Tensor superblock_repack(at::TensorList blocks, at::IntArrayRef types, int64_t in_features) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == types.size() && static_cast<int64_t>(blocks.size()) <= MAX_PARTS,
              "superblock_repack: one type per part, 1 to ", MAX_PARTS, " parts");
  int64_t total = HEADER_BYTES, N = 0;
  for (size_t p = 0; p < blocks.size(); ++p) {
    const int64_t t = types[p];
    TORCH_CHECK(is_type(t), "superblock_repack: type ", t,
                " is not Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS");
    TORCH_CHECK(in_features % super_elements(t) == 0, "superblock_repack: ", in_features, " inputs are not whole ",
                type_name(t), " super-blocks of ", super_elements(t));
    TORCH_CHECK(blocks[p].dim() == 2 && blocks[p].scalar_type() == at::kByte && blocks[p].size(0) > 0 &&
                    blocks[p].size(1) == in_features / super_elements(t) * stored_bytes(t),
                "superblock_repack: part ", p, " is not [rows, ", in_features / super_elements(t) * stored_bytes(t),
                "] bytes of ", type_name(t));
    total += part_bytes(t, blocks[p].size(0), in_features);
    N += blocks[p].size(0);
  }
  at::Tensor out = huge_page_zeros(total);
  int64_t words[HEADER_BYTES / 8] = {MAGIC, in_features, N, static_cast<int64_t>(blocks.size())};
  uint8_t* base = out.data_ptr<uint8_t>();
  int64_t offset = HEADER_BYTES;
  for (size_t p = 0; p < blocks.size(); ++p) {
    const int64_t t = types[p], rows = blocks[p].size(0), supers = in_features / super_elements(t);
    words[4 + 2 * p] = t;
    words[5 + 2 * p] = rows;
    const at::Tensor src = blocks[p].contiguous();
    const uint8_t* w = src.data_ptr<uint8_t>();
    uint8_t* dst = base + offset;
    at::parallel_for(0, (rows + COLS - 1) / COLS, 1, [&](int64_t begin, int64_t end) {
      Decoded s;
      for (int64_t tile = begin; tile < end; ++tile)
        for (int64_t c = 0; c < COLS && tile * COLS + c < rows; ++c)
          for (int64_t k = 0; k < supers; ++k) {
            decode(w + ((tile * COLS + c) * supers + k) * stored_bytes(t), t, s);
            write_record_row(s, t, c, dst + (tile * supers + k) * record_bytes(t));
          }
    });
    offset += part_bytes(t, rows, in_features);
  }
  std::memcpy(base, words, HEADER_BYTES);
  return out;
}

at::Tensor superblock_gemm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "superblock_gemm: x must be float32 [M, K]");
  return gemm(x, x.size(1), packed, pagoda::ggml::quantize_rows, [](const at::Tensor& rows) { return rows; });
}

// The registered op names the output width, so that torch.compile's shape-only version knows it.
at::Tensor superblock_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  at::Tensor y = superblock_gemm(x, packed);
  TORCH_CHECK(y.size(1) == out_features, "superblock_gemm: the weight has ", y.size(1), " outputs, not ", out_features);
  return y;
}

// silu(gate) * up of gate_up [M, 2K], then the packed weight: superblock_gemm(silu_and_mul(gate_up))
// bit for bit, the activations quantized as they are made (ggml_blocks.h).
at::Tensor silu_mul_superblock_gemm(const at::Tensor& gate_up, const at::Tensor& packed) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.size(1) % 2 == 0,
              "silu_mul_superblock_gemm: gate_up must be float32 [M, 2K]");
  return gemm(gate_up, gate_up.size(1) / 2, packed, pagoda::ggml::quantize_silu_mul_rows,
              [](const at::Tensor& rows) { return pagoda::silu_and_mul(rows); });
}

// Rows `ids` of the packed weight, dequantized to float32 [len(ids), K] (an embedding's lookup):
// value = d * sc * code - dmin * mn, as ggml's dequantize_row_* computes it.
at::Tensor superblock_rows(const at::Tensor& packed, const at::Tensor& ids) {
  const Header h = read_header(packed);
  const at::Tensor index = ids.to(at::kLong).contiguous().view({-1});
  at::Tensor out = at::empty({index.numel(), h.K}, at::kFloat);
  const int64_t* id = index.data_ptr<int64_t>();
  float* y = out.data_ptr<float>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < h.N, "superblock_rows: row ", id[i], " is out of range for ", h.N, " rows");
  at::parallel_for(0, index.numel(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      size_t p = 0;
      while (id[i] >= h.parts[p].col + h.parts[p].rows) ++p;
      const Part& part = h.parts[p];
      const int64_t row = id[i] - part.col, c = row % COLS, t = part.type, super = super_elements(t);
      for (int64_t s = 0; s < part.supers; ++s) {
        const uint8_t* rec = part.data + row / COLS * part.tile_bytes + s * record_bytes(t);
        const float d = fp16(rec + 2 * c), dmin = has_mins(t) ? fp16(rec + 32 + 2 * c) : 0.f;
        for (int64_t e = 0; e < super; ++e) {
          const float scale = d * static_cast<float>(record_scale(rec, t, c, e));
          const float value = scale * static_cast<float>(code_value(t, record_code(rec, t, c, e)));
          y[i * h.K + s * super + e] = value - dmin * static_cast<float>(record_min(rec, t, c, e));
        }
      }
    }
  });
  return out;
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("superblock_repack(Tensor[] blocks, int[] types, int in_features) -> Tensor");
  m.def("superblock_gemm(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("silu_mul_superblock_gemm(Tensor gate_up, Tensor packed) -> Tensor");
  m.def("superblock_rows(Tensor packed, Tensor ids) -> Tensor");
  m.def("superblock_isa() -> str", []() { return std::string(isa()); });
  // from how many rows superblock_gemm takes the bf16 route outside deterministic inference (0: none here)
  m.def("superblock_bf16_rows() -> int", []() -> int64_t {
#if defined(PAGODA_AMX_BF16)
    return amx_usable() ? BF16_MIN_ROWS : 0;
#else
    return 0;
#endif
  });
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("superblock_repack", &pagoda::superblock_repack);
  m.impl("superblock_gemm", &pagoda::superblock_linear);
  m.impl("silu_mul_superblock_gemm", &pagoda::silu_mul_superblock_gemm);
  m.impl("superblock_rows", &pagoda::superblock_rows);
}
