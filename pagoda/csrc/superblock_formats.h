// ggml's super-block formats (K-quants Q4_K, Q5_K, Q6_K and the non-linear IQ4_XS, IQ4_NL), decoded
// from a GGUF's blocks and repacked once at load into tiles of 16 weight rows for
// superblock_kernels.h, as block_gemm_tiles.cpp repacks Q4_0 / Q4_1 / Q8_0.
//
// Each format is, per block of 32 elements, an integer code times a scale (plus, for Q4_K / Q5_K, a
// minimum): the scales are 6- or 8-bit integers under one fp16 `d` per super-block of 256 (ggml's
// ggml-common.h and dequantize_row_*). A tile keeps that hierarchy, so it takes the file's bytes
// (to within 2 %): a super-block's record for the tile's 16 rows is
//   scales   Q4_K, Q5_K: d fp16[16], dmin fp16[16], sc u8[8][16], m u8[8][16]     (320 bytes)
//            Q6_K:       d fp16[16], sc i8[16][16]  (one scale per 16 elements)     (288 bytes)
//            IQ4_XS:     d fp16[16], sc i8[8][16]   (ls - 32)                       (160 bytes)
//            IQ4_NL, Q4_0, Q5_0, Q8_0: d fp16[16] (a "super-block" of one block)   ( 32 bytes)
//            Q4_1, Q5_1: d fp16[16], -m fp16[16]                                   ( 64 bytes)
//   then per block of 32, its codes as 64-byte vectors, row c at bytes 4c .. 4c+3 of each:
//     4 nibble vectors: vector j holds elements 4j .. 4j+3 in its low nibbles, 16+4j .. in its high
//     Q5_K, Q5_0, Q5_1: 1 vector of 5th bits: bit j of byte (c, i) is element 4j+i's, bit 4+j
//           element 16+4j+i's
//     Q8_0: instead of nibbles, 8 vectors of whole codes (+ 128): vector j elements 4j.., 4+j 16+4j..
//     Q6_K: instead, 6 vectors of 6-bit codes: for each half h of 16 elements (vectors 3h .. 3h+2),
//           vector 3h+j (j < 3) holds element 16h+4j+i's code in bits 0-5 of byte (c, i), and in
//           bits 6-7 two bits of element 16h+12+i's (its bits 4-5 in vector 3h, 2-3 in 3h+1, 0-1 in
//           3h+2): a mask gives three codes, and the fourth is gathered from the three top pairs,
//           fewer instructions than a nibble and a pair of high bits for every code
// so one vpdpbusd against 4 activation bytes broadcast advances 16 outputs by 4 products each.
// The codes are unsigned: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 (the value is code - 32), IQ4 an index
// into kIQ4Values.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace pagoda::superblock {

// GGMLQuantizationType values: the super-block formats, and the blocks of 32 that a file mixes with
// them (a small model's Q4_K_M falls back to Q5_0 / Q8_0 where a row is not whole super-blocks)
enum Type : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23
};
constexpr int64_t COLS = 16;     // weight rows in a tile
constexpr int64_t BLOCK = 32;    // elements a set of code vectors covers (an activation block)
constexpr int64_t PACKED = 1000;  // block_matmul's type for a weight held as these tiles

// IQ4_NL / IQ4_XS: the 16 values a 4-bit index stands for (ggml's kvalues_iq4nl)
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

constexpr bool is_type(int64_t t) {
  return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0 || t == Q4_K || t == Q5_K || t == Q6_K ||
         t == IQ4_NL || t == IQ4_XS;
}
constexpr bool is_k_quant(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K || t == IQ4_XS; }
constexpr int64_t super_elements(int64_t t) { return is_k_quant(t) ? 256 : 32; }
constexpr int64_t blocks_per_super(int64_t t) { return super_elements(t) / BLOCK; }
constexpr int64_t stored_bytes(int64_t t) {  // one super-block in the file
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case IQ4_XS: return 136;
    default: return 18;  // IQ4_NL
  }
}
constexpr bool has_fifth_bit(int64_t t) { return t == Q5_K || t == Q5_0 || t == Q5_1; }
// Vectors of 5th bits after a block's 4 nibble vectors
constexpr int64_t high_vectors(int64_t t) { return has_fifth_bit(t) ? 1 : 0; }
// A block's code vectors: 4 of nibbles (+ the 5th bits'), Q6_K's 6 of 6-bit codes, Q8_0's 8 of bytes
constexpr int64_t code_vectors(int64_t t) { return t == Q6_K ? 6 : t == Q8_0 ? 8 : 4 + high_vectors(t); }
constexpr int64_t block_code_bytes(int64_t t) { return code_vectors(t) * 64; }
constexpr bool has_mins(int64_t t) { return t == Q4_K || t == Q5_K || t == Q4_1 || t == Q5_1; }
constexpr bool has_min_bytes(int64_t t) { return t == Q4_K || t == Q5_K; }  // 6-bit minimums under dmin
constexpr int64_t scale_bytes(int64_t t) {
  return has_min_bytes(t) ? 320 : t == Q6_K ? 288 : t == IQ4_XS ? 160 : has_mins(t) ? 64 : 32;
}
constexpr int64_t record_bytes(int64_t t) { return scale_bytes(t) + blocks_per_super(t) * block_code_bytes(t); }
constexpr bool is_iq4(int64_t t) { return t == IQ4_NL || t == IQ4_XS; }
// value = code - code_offset (Q8_0's codes are stored + 128, unsigned; IQ4's index a table instead)
constexpr int32_t code_offset(int64_t t) {
  return t == Q4_0 ? 8 : t == Q5_0 ? 16 : t == Q6_K ? 32 : t == Q8_0 ? 128 : 0;
}

inline const char* type_name(int64_t t) {
  switch (t) {
    case Q4_0: return "Q4_0";
    case Q4_1: return "Q4_1";
    case Q5_0: return "Q5_0";
    case Q5_1: return "Q5_1";
    case Q8_0: return "Q8_0";
    case Q4_K: return "Q4_K";
    case Q5_K: return "Q5_K";
    case Q6_K: return "Q6_K";
    case IQ4_NL: return "IQ4_NL";
    case IQ4_XS: return "IQ4_XS";
  }
  return "?";
}

// One row's super-block, decoded: value of element e =
//   Q4_K, Q5_K  d * sc[e / 32] * code[e] - dmin * mn[e / 32]
//   Q6_K        d * sc[e / 16] * (code[e] - 32)
//   IQ4_XS      d * sc[e / 32] * kIQ4Values[code[e]]
//   IQ4_NL      d * kIQ4Values[code[e]]
//   Q4_0, Q5_0  d * (code[e] - 8 | 16);   Q8_0  d * (code[e] - 128)
//   Q4_1, Q5_1  d * code[e] - dmin, dmin being the file's -m
struct Decoded {
  uint8_t code[256];
  int8_t sc[16];
  uint8_t mn[8];
  uint16_t d, dmin;  // fp16 bits
};

// ggml's get_scale_min_k4: Q4_K / Q5_K's 6-bit scale and minimum of block j from their 12 bytes.
inline void scale_min_k4(int j, const uint8_t* q, int8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = static_cast<int8_t>(q[j] & 63);
    *mn = q[j + 4] & 63;
  } else {
    *sc = static_cast<int8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *mn = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline void decode_k4(const uint8_t* blk, int64_t t, Decoded& out) {  // Q4_K, Q5_K
  out.d = u16(blk);
  out.dmin = u16(blk + 2);
  for (int j = 0; j < 8; ++j) scale_min_k4(j, blk + 4, &out.sc[j], &out.mn[j]);
  const uint8_t* qh = blk + 16;                 // Q5_K's 5th bits
  const uint8_t* qs = blk + (t == Q5_K ? 48 : 16);
  for (int chunk = 0; chunk < 4; ++chunk)
    for (int l = 0; l < 32; ++l) {
      const uint8_t q = qs[32 * chunk + l];
      uint8_t lo = q & 0xF, hi = q >> 4;
      if (t == Q5_K) {
        lo |= ((qh[l] >> (2 * chunk)) & 1) << 4;
        hi |= ((qh[l] >> (2 * chunk + 1)) & 1) << 4;
      }
      out.code[64 * chunk + l] = lo;
      out.code[64 * chunk + 32 + l] = hi;
    }
}

inline void decode_q6_k(const uint8_t* blk, Decoded& out) {
  const uint8_t *ql = blk, *qh = blk + 128;
  for (int i = 0; i < 16; ++i) out.sc[i] = static_cast<int8_t>(blk[192 + i]);
  out.d = u16(blk + 208);
  out.dmin = 0;
  for (int n = 0; n < 2; ++n)
    for (int l = 0; l < 32; ++l) {
      const uint8_t *L = ql + 64 * n, *H = qh + 32 * n;
      uint8_t* c = out.code + 128 * n;
      c[l] = (L[l] & 0xF) | (((H[l] >> 0) & 3) << 4);
      c[l + 32] = (L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4);
      c[l + 64] = (L[l] >> 4) | (((H[l] >> 4) & 3) << 4);
      c[l + 96] = (L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4);
    }
}

inline void decode_iq4(const uint8_t* blk, int64_t t, Decoded& out) {
  out.d = u16(blk);
  out.dmin = 0;
  const int blocks = static_cast<int>(blocks_per_super(t));
  const uint8_t* qs = blk + (t == IQ4_XS ? 8 : 2);
  for (int b = 0; b < blocks; ++b) {
    if (t == IQ4_XS) {
      const uint16_t high = u16(blk + 2);
      const int ls = ((blk[4 + b / 2] >> (4 * (b % 2))) & 0xF) | (((high >> (2 * b)) & 3) << 4);
      out.sc[b] = static_cast<int8_t>(ls - 32);
    } else {
      out.sc[b] = 1;
    }
    for (int j = 0; j < 16; ++j) {
      out.code[32 * b + j] = qs[16 * b + j] & 0xF;
      out.code[32 * b + 16 + j] = qs[16 * b + j] >> 4;
    }
  }
}

inline void decode_block32(const uint8_t* blk, int64_t t, Decoded& out) {  // Q4_0 ... Q8_0
  out.d = u16(blk);
  const bool with_m = t == Q4_1 || t == Q5_1;
  out.dmin = with_m ? static_cast<uint16_t>(u16(blk + 2) ^ 0x8000) : 0;  // -m: the sign bit flipped, exact
  const uint8_t* q = blk + (with_m ? 4 : 2);
  if (t == Q8_0) {
    for (int j = 0; j < 32; ++j) out.code[j] = static_cast<uint8_t>(static_cast<int8_t>(q[j]) + 128);
    return;
  }
  uint32_t high = 0;
  if (has_fifth_bit(t)) {
    std::memcpy(&high, q, 4);
    q += 4;
  }
  for (int j = 0; j < 16; ++j) {
    out.code[j] = static_cast<uint8_t>((q[j] & 0xF) | (((high >> j) & 1) << 4));
    out.code[j + 16] = static_cast<uint8_t>((q[j] >> 4) | (((high >> (j + 16)) & 1) << 4));
  }
}

inline void decode(const uint8_t* blk, int64_t t, Decoded& out) {
  if (!is_k_quant(t) && !is_iq4(t)) decode_block32(blk, t, out);
  else if (t == Q6_K) decode_q6_k(blk, out);
  else if (is_iq4(t)) decode_iq4(blk, t, out);
  else decode_k4(blk, t, out);
}

// Writes row c's decoded super-block into a tile's record (see the layout above).
inline void write_record_row(const Decoded& s, int64_t t, int64_t c, uint8_t* rec) {
  std::memcpy(rec + 2 * c, &s.d, 2);
  const int64_t blocks = blocks_per_super(t);
  if (has_mins(t)) std::memcpy(rec + 32 + 2 * c, &s.dmin, 2);
  if (has_min_bytes(t)) {
    for (int64_t b = 0; b < 8; ++b) {
      rec[64 + 16 * b + c] = static_cast<uint8_t>(s.sc[b]);
      rec[192 + 16 * b + c] = s.mn[b];
    }
  } else if (t == Q6_K) {
    for (int64_t h = 0; h < 16; ++h) rec[32 + 16 * h + c] = static_cast<uint8_t>(s.sc[h]);
  } else if (t == IQ4_XS) {
    for (int64_t b = 0; b < 8; ++b) rec[32 + 16 * b + c] = static_cast<uint8_t>(s.sc[b]);
  }
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* codes = rec + scale_bytes(t) + b * block_code_bytes(t);
    const uint8_t* e = s.code + 32 * b;
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) {
        const uint8_t lo = e[4 * j + i], hi = e[16 + 4 * j + i];
        const int64_t at = 4 * c + i;
        if (t == Q8_0) {
          codes[64 * j + at] = lo;
          codes[256 + 64 * j + at] = hi;
          continue;
        }
        if (t == Q6_K) {
          if (j == 3) continue;  // the fourth code is spread over the top bits of the other three
          const int shift = 4 - 2 * j;
          codes[64 * j + at] = static_cast<uint8_t>(lo | ((e[12 + i] >> shift) & 3) << 6);
          codes[192 + 64 * j + at] = static_cast<uint8_t>(hi | ((e[28 + i] >> shift) & 3) << 6);
          continue;
        }
        codes[64 * j + at] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
        if (has_fifth_bit(t))
          codes[256 + at] |= static_cast<uint8_t>((((lo >> 4) & 1) << j) | (((hi >> 4) & 1) << (4 + j)));
      }
  }
}

// ---- reading a record back (the scalar kernel and superblock_rows) ----------------------------

inline uint8_t record_code(const uint8_t* rec, int64_t t, int64_t c, int64_t e) {
  const int64_t b = e / 32, k = e % 32, half = k / 16, j = (k % 16) / 4, i = k % 4, at = 4 * c + i;
  const uint8_t* codes = rec + scale_bytes(t) + b * block_code_bytes(t);
  if (t == Q8_0) return codes[256 * half + 64 * j + at];
  if (t == Q6_K) {
    const uint8_t* v = codes + 192 * half + at;
    if (j < 3) return v[64 * j] & 0x3F;
    return static_cast<uint8_t>((v[0] >> 6) << 4 | (v[64] >> 6) << 2 | v[128] >> 6);
  }
  uint8_t code = (codes[64 * j + at] >> (4 * half)) & 0xF;
  if (has_fifth_bit(t)) code |= ((codes[256 + at] >> (j + 4 * half)) & 1) << 4;
  return code;
}

// The signed integer value of a code (before any scale): the kernels' integer products use it.
inline int32_t code_value(int64_t t, uint8_t code) { return is_iq4(t) ? kIQ4Values[code] : code - code_offset(t); }

// The per-block scale integer: sc of element e's block (Q6_K: of its 16), 1 for IQ4_NL.
inline int32_t record_scale(const uint8_t* rec, int64_t t, int64_t c, int64_t e) {
  if (has_min_bytes(t)) return rec[64 + 16 * (e / 32) + c];
  if (t == Q6_K) return static_cast<int8_t>(rec[32 + 16 * (e / 16) + c]);
  if (t == IQ4_XS) return static_cast<int8_t>(rec[32 + 16 * (e / 32) + c]);
  return 1;
}

inline int32_t record_min(const uint8_t* rec, int64_t t, int64_t c, int64_t e) {
  return has_min_bytes(t) ? rec[192 + 16 * (e / 32) + c] : has_mins(t) ? 1 : 0;
}

}  // namespace pagoda::superblock
