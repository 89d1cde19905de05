// Small-sequence attention forward for grouped heads (GQA/MQA, Hq = G * Hkv with G > 1) on NVIDIA
// tensor cores (sm_80+): the contract of smallseq/forward.hip. Heads without sharing (G = 1) keep
// smallseq/forward_mma.hip, one problem per (sequence, head).
//
// A team of warps serves one (sequence, KV head) group at a time and walks a run of them. Per group
// it stages K and V once, then walks the group's stacked query rows (smallseq/group_tiles.h) in
// chunks of 16, one m16 tile each, with the next chunk's Q rows in flight (cp.async into the second
// chunk tile) while this one computes: S = Q Kᵀ (three 8-key tiles), the softmax on the
// accumulators, P normalised and reused as the A operand of O = P V, O written back over the chunk's
// Q rows and out with 16-byte stores. The LSE of each stacked row goes to its head's row. With
// SCORE_MODS the scores take softcap and ALiBi (common/score_mods.h), each stacked row its own head's slope,
// its head's learnable sink joins its softmax sum (common/sink.h), and dropout (common/dropout.h) drops
// with its head's keep bits.
//
// Why this shape. MHA's one-problem-per-head kernel, given GQA, stages Q, K and V per query head: at
// G = 4 and lengths drawn from 1..17 (mean 9, head_dim 128) that is 1.6x the floor's bytes, and it
// ran at 1.8-2.1x the floor. Here K and V cross once per group, so the bytes staged are the floor's,
// and stacked rows fill the m16 tiles: 2.6 chunks a group of 4 heads instead of the 4.2 mostly-empty
// tiles of one problem per head. What remains is issue-bound. A chunk of 16 rows with at most 16 keys
// is about 485 instructions of SASS at head_dim 64 and 665 at 128 (ptxas for sm_90a), 30-40% of them
// the copies of the stacked rows, whose bytes halve with head_dim while the softmax's instructions do
// not. Each lane's walk over those rows carries on from chunk to chunk (StackedRowCursor), so a chunk
// no longer pays for finding its rows (550 and 690 instructions before; 1.5-3% faster at head_dim 64
// on the H200). On the H200 head_dim 128 and 256 run at 1.05-1.18x the floor, head_dim 64 at
// 1.13-1.29x, the largest groups the slowest (BENCHMARKS.md). Issuing the next group's copies during a
// group's last chunk, to hide the wait at each group's start, measured no gain.
// Shared memory sets the warps per SM (20, 12, 10 at head_dim 64, 128, 256).
//
// SPLIT warps share a group (a team), each staging HEAD_DIM / SPLIT columns. With SPLIT = 2 each
// hands its partial S of a chunk to the other through a slot of its own (two slots, alternating with
// the chunk, so one barrier per chunk orders them), both add the two halves (a + b == b + a: both
// hold the same S) and run the same softmax, and each computes its columns of O.
#pragma once
#include "smallseq/group_tiles.h"

namespace hipattn {
namespace smallseq {

// One team's shared memory, in bytes from its base. Per warp: a zero row; K and V tiles of TILE
// rows; two chunk tiles of 16 stacked query rows (this chunk, and the next one in flight); with
// SPLIT = 2 two slots for the partial S it hands the other warp. Rows are HEAD_DIM / SPLIT + 8
// elements (the pad spreads ldmatrix's eight row reads over the banks). The host's row
// (hipattn/catalog/smallseq.py, SmallSeqForwardGqaMmaTiles.team_bytes) computes kBytes from the same
// arguments.
template <typename T, int HEAD_DIM, int TILE, int SPLIT>
struct GqaForwardTeamTiles {
  static constexpr int kCols = HEAD_DIM / SPLIT;
  static constexpr int kPitchBytes = (kCols + 8) * static_cast<int>(sizeof(T));
  static constexpr int kKeyTileBytes = TILE * kPitchBytes;
  static constexpr int kChunkBytes = kChunkRows * kPitchBytes;
  static constexpr int kKOffset = kPitchBytes;  // after the zero row
  static constexpr int kVOffset = kKOffset + kKeyTileBytes;
  static constexpr int kChunksOffset = kVOffset + kKeyTileBytes;
  static constexpr int kSlotsOffset = kChunksOffset + 2 * kChunkBytes;
  static constexpr int kSlotBytes = ChunkExchange<1>::kBytes;
  static constexpr int kWarpBytes = kSlotsOffset + (SPLIT == 1 ? 0 : 2 * kSlotBytes);
  static constexpr int kBytes = SPLIT * kWarpBytes;
  static_assert(SPLIT == 1 || SPLIT == 2, "one warp per group, or two that split its columns");
  static_assert(HEAD_DIM % (16 * SPLIT) == 0, "each warp takes whole 16-column mma steps");
  static_assert(kPitchBytes % 16 == 0, "cp.async and ldmatrix need 16-byte aligned rows");
};

// One chunk of a group: O and LSE of stacked rows [first, first + 16) over this warp's columns, with
// the chunk's Q rows staged in chunk tile `slot`; O overwrites them on its way out. With SPLIT = 2 the
// partial S goes through exchange slot `slot` (the same parity). WIDE: the group has more than 16
// keys, so S takes a third 8-key tile and O a second 16-key step; a compile-time choice, because a
// branch around each of those steps cost a branch, a warp barrier and a rebuilt address per step
// (about a tenth of a chunk's instructions).
template <typename T, int HEAD_DIM, int TILE, int SPLIT, int TEAMS, bool WIDE, bool SCORE_MODS>
HIPATTN_DEVICE void forward_chunk(const SmallSeqForwardGqaMmaParams& p, const Group& x, const StackedRows& stacked,
                                  StackedRowCursor<T, HEAD_DIM / SPLIT>& o_rows, int first, int slot,
                                  const TilePlaces& places, int team, int part, int lane) {
  using Team = GqaForwardTeamTiles<T, HEAD_DIM, TILE, SPLIT>;
  constexpr int COLS = Team::kCols;
  constexpr int kPitchBytes = Team::kPitchBytes;
  const int len_q = x.q.length;
  const int len_k = x.k.length;
  const int rows = stacked.count - first < kChunkRows ? stacked.count - first : kChunkRows;
  const unsigned int zero = places.warp_address(0);
  const unsigned int k_tile = zero + Team::kKOffset;
  const unsigned int v_tile = zero + Team::kVOffset;
  const unsigned int q_tile = zero + Team::kChunksOffset + slot * Team::kChunkBytes;
  unsigned char* const chunk = places.warp_bytes(Team::kChunksOffset) + slot * Team::kChunkBytes;
  const int g = lane / 4;  // fragment row within the chunk (and +8)
  const int t = lane % 4;  // fragment column pair

  // ---- S = Q Kᵀ over this warp's columns, keys [0, 24) ----
  const unsigned int q_row = row_or_zero(q_tile, zero, lane % 16, rows, kPitchBytes) + 16 * (lane / 16);
  const unsigned int k_rows01 =
      row_or_zero(k_tile, zero, 8 * (lane / 16) + lane % 8, len_k, kPitchBytes) + 16 * ((lane / 8) % 2);
  const unsigned int k_row2 = row_or_zero(k_tile, zero, 16 + lane % 8, len_k, kPitchBytes) + 16 * ((lane / 8) % 2);
  // Even and odd k-steps accumulate apart, then add: each accumulator's chain of dependent mma is half
  // as long (COLS / 32 instead of COLS / 16), so the tensor core has twice the independent work.
  float scores[3][4] = {}, odd[3][4] = {};
#pragma unroll
  for (int ks = 0; ks < COLS / 16; ++ks) {
    float (&sums)[3][4] = ks % 2 == 0 ? scores : odd;
    unsigned int a[4];
    mma::ldmatrix_x4(a, q_row + 32 * ks);
    {  // keys 0..15 (with no key at all, K's zero row: S = 0, masked below)
      unsigned int b[4];
      mma::ldmatrix_x4(b, k_rows01 + 32 * ks);
      mma::mma_16816<T>(sums[0], a, b[0], b[1]);
      mma::mma_16816<T>(sums[1], a, b[2], b[3]);
    }
    if (WIDE) {
      unsigned int b[2];
      mma::ldmatrix_x2(b, k_row2 + 32 * ks);
      mma::mma_16816<T>(sums[2], a, b[0], b[1]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 3; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) scores[nt][e] += odd[nt][e];
  if (SPLIT == 2) {
    // This warp's slots follow its tiles; the other warp's lie kWarpBytes before or after them.
    unsigned char* const my_slot = places.warp_bytes(Team::kSlotsOffset) + slot * Team::kSlotBytes;
    hand_over_chunk_scores(my_slot, 0, scores, lane);
    team_sync<SPLIT, TEAMS>(team);
    add_chunk_scores(my_slot + (1 - 2 * part) * Team::kWarpBytes, 0, scores, lane);
  }
  __syncwarp();  // every lane has read the chunk's Q rows; O is staged over them

  // ---- softmax on the accumulators: a row's 24 scores live in the 4 lanes of one quad ----
  // Each stacked row has its own query head, so its own scores (ALiBi's slope; plain: one scale for all).
  const Scores<SCORE_MODS> group_score = scores_of<SCORE_MODS>(p, x.batch_index, x.head_kv * stacked.group);
  const KeyWindow window = key_window(p);
  int query[2], head[2];
  RowKeys keys[2];
  Scores<SCORE_MODS> row_score[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = first + g + 8 * r;
    query[r] = stacked.query(row);
    head[r] = row - query[r] * stacked.group;
    keys[r] = stacked_row_keys(row, query[r], stacked, len_q, len_k, window);
    row_score[r] = group_score.with_head(p, x.batch_index, x.head_kv * stacked.group + head[r]);
  }
  float row_max[2] = {-infinity(), -infinity()};
#pragma unroll
  for (int nt = 0; nt < 3; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = 8 * nt + 2 * t + (e & 1);
      const int r = e / 2;
      // Plain rows share the group's scale; taking it from row_score[r] compiled to other (if equal) code.
      const Scores<SCORE_MODS>& score = SCORE_MODS ? row_score[r] : group_score;
      scores[nt][e] = keys[r].contains(j) ? score(scores[nt][e], j - (query[r] + len_k - len_q)) : -infinity();
      row_max[e / 2] = fmaxf(row_max[e / 2], scores[nt][e]);
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_max[r] = fmaxf(row_max[r], shfl_xor(row_max[r], 1, 32, 0xffffffffu));
    row_max[r] = fmaxf(row_max[r], shfl_xor(row_max[r], 2, 32, 0xffffffffu));
  }
  float row_sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < 3; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float m = row_max[e / 2];
      scores[nt][e] = m == -infinity() ? 0.0f : fast_exp2(scores[nt][e] - m);
      row_sum[e / 2] += scores[nt][e];
    }
  float inv_sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += shfl_xor(row_sum[r], 1, 32, 0xffffffffu);
    row_sum[r] += shfl_xor(row_sum[r], 2, 32, 0xffffffffu);
    // 1 / sum as 2^-log2(sum), from the log2 the LSE takes anyway (relative error ~3e-7 for the sums
    // of 1 to 24 that a row with a key has): an IEEE division brings a slow-path call, and around it
    // ptxas spilled the loop's counters. A row that sees no key: O = 0 and LSE = +inf (flash-attn's
    // convention; see forward.hip). With a sink (the modified kernel, when the call passes one),
    // common/sink.h's row ends instead.
    const float sink = sink_log2<SCORE_MODS>(p, x.head_kv * stacked.group + head[r]);
    const float sum_log2 = fast_log2(row_sum[r]);
    inv_sum[r] = sink != -infinity() ? row_inv_sum(row_max[r], row_sum[r], sink)
                 : row_sum[r] > 0.0f ? fast_exp2(-sum_log2)
                                     : 0.0f;
    if (part == 0 && t == 0 && first + g + 8 * r < stacked.count) {
      static_cast<float*>(p.lse)[x.batch_index * p.lse_batch_stride +
                                 (x.head_kv * stacked.group + head[r]) * p.lse_head_stride + x.q.start + query[r]] =
          sink != -infinity() ? row_lse(row_max[r], row_sum[r], sink)
          : row_sum[r] > 0.0f ? (row_max[r] + sum_log2) * kLn2
                              : infinity();
    }
  }

  // Dropout after the sum and the LSE: each row's keep bits are its own head's; a kept probability's
  // weight is 1 / sum / (1 - dropout_p), a dropped one's 0.
  float weight[3][4];
#pragma unroll
  for (int nt = 0; nt < 3; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) weight[nt][e] = inv_sum[e / 2];
  const Dropout<SCORE_MODS> group_dropout = dropout_of<SCORE_MODS>(p, x.batch_index, x.head_kv * stacked.group);
  if (group_dropout.active()) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const Dropout<SCORE_MODS> dropout =
          group_dropout.with_head(p, x.batch_index, x.head_kv * stacked.group + head[r]);
      const unsigned long long kept = dropout.template m16n8_bits<4>(query[r], 0, t);  // keys 0..31
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          weight[nt][2 * r + h] = (kept >> (2 * nt + h) & 1ull) != 0 ? inv_sum[r] * dropout.scale() : 0.0f;
    }
  }

  // ---- O = P V over this warp's columns, P normalised first (12 multiplies where O would take COLS / 2) ----
  unsigned int pa[2][4];
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    pa[kk][0] = mma::pack2<T>(scores[2 * kk][0] * weight[2 * kk][0], scores[2 * kk][1] * weight[2 * kk][1]);
    pa[kk][1] = mma::pack2<T>(scores[2 * kk][2] * weight[2 * kk][2], scores[2 * kk][3] * weight[2 * kk][3]);
    // keys 24..31 do not exist
    pa[kk][2] = kk == 0 ? mma::pack2<T>(scores[1][0] * weight[1][0], scores[1][1] * weight[1][1]) : 0u;
    pa[kk][3] = kk == 0 ? mma::pack2<T>(scores[1][2] * weight[1][2], scores[1][3] * weight[1][3]) : 0u;
  }
  // Every 16-column product first, then the stores: a store right after its product waited out the
  // mma's latency once per 16 columns.
  float o[COLS / 16][2][4] = {};
#pragma unroll
  for (int kk = 0; kk < (WIDE ? 2 : 1); ++kk) {
    const unsigned int v_row =
        row_or_zero(v_tile, zero, 16 * kk + lane % 8 + 8 * ((lane / 8) % 2), len_k, kPitchBytes) + 16 * (lane / 16);
#pragma unroll
    for (int nt = 0; nt < COLS / 16; ++nt) {
      unsigned int b[4];
      mma::ldmatrix_x4_trans(b, v_row + 32 * nt);
      mma::mma_16816<T>(o[nt][0], pa[kk], b[0], b[1]);
      mma::mma_16816<T>(o[nt][1], pa[kk], b[2], b[3]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < COLS / 16; ++nt)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (g + 8 * r < rows)
          *reinterpret_cast<unsigned int*>(chunk + (g + 8 * r) * kPitchBytes + 32 * nt + 16 * half + 4 * t) =
              mma::pack2<T>(o[nt][half][2 * r], o[nt][half][2 * r + 1]);
  __syncwarp();
  // ---- O's rows (this warp's columns) out with 16-byte stores ----
  store_stacked_rows(o_rows, chunk, stacked, rows, lane);
}

// Issue the copies of the Q rows of chunk [first, first + 16) of a group, the chunk `q_rows` stands at
// (this warp's columns).
template <typename T, int COLS>
HIPATTN_DEVICE void stage_forward_chunk(const StackedRows& stacked, StackedRowCursor<const T, COLS>& q_rows,
                                        int first, unsigned int chunk, int lane) {
  const int rows = stacked.count - first < kChunkRows ? stacked.count - first : kChunkRows;
  stage_stacked_rows(chunk, q_rows, stacked, rows, lane);
}

}  // namespace smallseq

// WARPS warps per block in teams of SPLIT, each team walking its run of problems_per_team groups; the
// host's table (catalog.smallseq.SMALLSEQ_GQA_FORWARD_MMA_TILES) sizes the dynamic shared memory.
// Warps of 64 columns need 9.4 KiB of it, so an H200 SM holds 20: the launch bounds ask ptxas for the
// registers of 20 (96, no spills). Wider warps need twice the shared memory and more, an SM holds at
// most 12 of them, and their registers (about 145) are left alone.
template <int WARPS, int COLS>
constexpr int kForwardBlocksPerSm = COLS == 64 ? 20 / WARPS : 1;

template <typename T, int HEAD_DIM, int TILE, int WARPS, int SPLIT, bool SCORE_MODS>
__global__ void __launch_bounds__(WARPS * 32, kForwardBlocksPerSm<WARPS, HEAD_DIM / SPLIT>)
    smallseq_forward_gqa_mma(const SmallSeqForwardGqaMmaParams p) {
  using Team = smallseq::GqaForwardTeamTiles<T, HEAD_DIM, TILE, SPLIT>;
  constexpr int COLS = Team::kCols;
  static_assert(TILE > 16 && TILE <= 24, "the fragments cover 24 keys and 2 k-steps of keys");
  static_assert(WARPS % SPLIT == 0, "whole teams");
  constexpr int TEAMS = WARPS / SPLIT;
  extern __shared__ __align__(16) unsigned char shared_bytes[];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int team = warp / SPLIT;
  const int part = warp % SPLIT;
  smallseq::Group x;
  if (!smallseq::first_group<TILE, TEAMS>(p, team, x)) return;  // a team past the last group; barriers are per team
  const smallseq::TilePlaces places{shared_bytes, team * Team::kBytes + part * Team::kWarpBytes, team * Team::kBytes};
  // The zero row; the first __syncwarp publishes it.
  smallseq::zero_bytes(places.warp_bytes(0), Team::kPitchBytes, lane);
  const int column = part * COLS;

  smallseq::StackedRows stacked = smallseq::stacked_rows(p.group_size);
  int walked = 0;  // chunks this team has computed: which chunk tile and exchange slot come next
  for (;;) {
    stacked.count = p.group_size * x.q.length;
    // The lane's first stacked Q and O rows of the group (this warp's columns): Q's cursor runs a chunk
    // ahead of O's, each chunk's stage and store moving it on to the next.
    auto q_rows = smallseq::StackedRowCursor<const T, COLS>::start(
        smallseq::group_rows(static_cast<const T*>(p.q), x, stacked, p.q_batch_stride, p.q_token_stride,
                             p.q_head_stride) + column,
        p.q_token_stride, p.q_head_stride, stacked, lane);
    auto o_rows = smallseq::StackedRowCursor<T, COLS>::start(
        smallseq::group_rows(static_cast<T*>(p.o), x, stacked, p.o_batch_stride, p.o_token_stride,
                             p.o_head_stride) + column,
        p.o_token_stride, p.o_head_stride, stacked, lane);
    if (stacked.count > 0) {  // no query rows: nothing to write (the same for the whole team)
      smallseq::stage_rows<T, COLS>(places.warp_bytes(Team::kKOffset),
                                    static_cast<const T*>(p.k) + x.batch_index * p.k_batch_stride +
                                        x.k.start * p.k_token_stride + x.head_kv * p.k_head_stride + column,
                                    p.k_token_stride, x.k.length, lane);
      smallseq::stage_rows<T, COLS>(places.warp_bytes(Team::kVOffset),
                                    static_cast<const T*>(p.v) + x.batch_index * p.v_batch_stride +
                                        x.k.start * p.v_token_stride + x.head_kv * p.v_head_stride + column,
                                    p.v_token_stride, x.k.length, lane);
      smallseq::stage_forward_chunk<T, COLS>(
          stacked, q_rows, 0, places.warp_address(Team::kChunksOffset) + (walked % 2) * Team::kChunkBytes, lane);
      mma::commit_async_copies();
    }
    for (int first = 0; first < stacked.count; first += smallseq::kChunkRows, ++walked) {
      const int slot = walked % 2;
      if (first + smallseq::kChunkRows < stacked.count) {
        // The next chunk's Q rows land in the other chunk tile while this one computes.
        smallseq::stage_forward_chunk<T, COLS>(
            stacked, q_rows, first + smallseq::kChunkRows,
            places.warp_address(Team::kChunksOffset) + (1 - slot) * Team::kChunkBytes, lane);
        mma::commit_async_copies();
        mma::wait_async_copies_except<1>();
      } else {
        mma::wait_async_copies_except<0>();
      }
      __syncwarp();
      if (x.k.length > 16)
        smallseq::forward_chunk<T, HEAD_DIM, TILE, SPLIT, TEAMS, true, SCORE_MODS>(p, x, stacked, o_rows, first, slot,
                                                                                   places, team, part, lane);
      else
        smallseq::forward_chunk<T, HEAD_DIM, TILE, SPLIT, TEAMS, false, SCORE_MODS>(p, x, stacked, o_rows, first, slot,
                                                                                    places, team, part, lane);
      __syncwarp();  // O has left the chunk tile before the chunk after next lands in it
    }
    // Every lane is done with K and V (the last chunk's O has been stored: __syncwarp above) before
    // the next group's copies land in them.
    if (!smallseq::next_group_of_block<TILE, TEAMS>(p, x)) break;
  }
}

}  // namespace hipattn
