// TensorFlow custom ops (CPU) around SBC's C kernels (sbc_kernels.c, linked in as a C object).
//
// Built on first use by horovod_sbc/kernels/__init__.py (build_tf_ops) and loaded with
// tf.load_op_library; horovod_sbc/tensorflow/backend/native.py drives the ops. The bytes and numbers are
// those of the C kernels, hence of the numpy reference (tests/golden, tests/test_differential.py).
//
// Why three ops, each doing a whole sequence in one Compute(): the C kernels keep positions in
// per-thread scratch between sbc_select and sbc_take, and TensorFlow may run two ops on two
// threads. So SbcEncode does selection + binarization mean + take + Rice parameter + streams +
// the error feedback's commit at once; SbcDecode writes positions into its own output
// tensor (sbc_decode_batch_into) and SbcScatterAdd reads them from there
// (sbc_scatter_add_groups_from): between the two the host judges the streams' statistics
// (horovod_sbc.protocol), so nothing is added before the verdict.
//
// Subnormals: TensorFlow runs CPU kernels with flush-to-zero and denormals-are-zero set; the
// protocol needs IEEE arithmetic (a subnormal value, mean or residual must survive), so every
// Compute() clears FTZ/DAZ for its duration and restores the caller's MXCSR (DenormalGuard).
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

extern "C" {
// declarations of sbc_kernels.c (documented there and in horovod_sbc/kernels/__init__.py)
int sbc_select(float *a, const float *g, int64_t n, int64_t k, int mode, int64_t *counts,
               double *sums, int64_t *dst, int *in_dst);
int sbc_take(int side, int64_t *dst);
void sbc_gap_shift_sums(const int64_t *pos, int64_t c, const int64_t *bs, int64_t nb,
                        int64_t *out);
void sbc_add_at(float *a, const int64_t *pos, int64_t count, float v);
int sbc_rice_encode(const int64_t *pos, int64_t c, int64_t b, uint8_t *unary, int64_t ubytes,
                    uint8_t *rem, int64_t rbytes);
int sbc_decode_batch_into(const uint8_t *buf, int64_t buflen, int64_t m, const int64_t *ustart,
                          const int64_t *ulen, const int64_t *rstart, const int64_t *rlen,
                          const int64_t *count, const int64_t *rb, const int64_t *numel,
                          int64_t *stats, uint32_t *pos);
int sbc_scatter_add_groups_from(const uint32_t *pos, int64_t npos, int64_t ng,
                                const int64_t *gstart, const int64_t *outs,
                                const int64_t *numel, const int64_t *pos_off,
                                const int64_t *count, const float *value, int zero);
}

namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
using tensorflow::errors::ResourceExhausted;
using tensorflow::errors::Internal;

constexpr int kOk = 0, kNonFinite = 1, kNoMem = -1;
constexpr int kMaxRiceB = 62;

// Clears flush-to-zero (bit 15) and denormals-are-zero (bit 6) of MXCSR for its lifetime.
class DenormalGuard {
 public:
  DenormalGuard() {
#if defined(__SSE__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~((1u << 15) | (1u << 6)));
#endif
  }
  ~DenormalGuard() {
#if defined(__SSE__)
    _mm_setcsr(saved_);
#endif
  }

 private:
  unsigned saved_ = 0;
};

inline uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float bits_f32(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// ------------------------------------------------------------------------------------------
// SbcEncode
// ------------------------------------------------------------------------------------------
REGISTER_OP("SbcEncode")
    .Input("update: float")  // numel elements, or none: A = residual
    .Input("residual: float")
    .Output("new_residual: float")
    .Output("header: int64")
    .Output("body: uint8")
    .Output("positions: int64")
    .Output("value: float")
    .Output("finite: bool")
    .Attr("k: int >= 0")
    .Attr("magnitude: bool = false")
    .Attr("rice_b1: int >= 0")
    .Attr("rice_steps: list(int) = []")
    .Attr("negative_flag: int")
    .SetIsStateful()  // never constant-folded or merged: it allocates in per-thread scratch
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext *c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->Vector(5));
      c->set_output(2, c->Vector(c->UnknownDim()));
      c->set_output(3, c->Vector(c->UnknownDim()));
      c->set_output(4, c->Scalar());
      c->set_output(5, c->Scalar());
      return tensorflow::OkStatus();
    })
    .Doc(R"doc(
SBC-encode A = residual + update (flat float32, same size; an empty update: A = residual): the
exact selection of
horovod_sbc.core (paper, or magnitude split with magnitude=true) of k per side, the side with the
larger mean (fixed-order float64 tree sums, mean rounded to float32), its Rice parameter
(b*(count) = rice_b1 - #{rice_steps <= count}, then the best of b*-1, b*, b*+1) and streams.
new_residual: A with the sent value subtracted at the sent positions (not committed: the caller
assigns it after the verdict). header: [flags, rice_b, count, unary_nbytes, value_bits]; body:
unary + remainder streams; positions: the sent ones; value: the signed float32 sent; finite:
false if A holds NaN or Inf (then header/body/positions are empty and new_residual is A).
)doc");

class SbcEncodeOp : public OpKernel {
 public:
  explicit SbcEncodeOp(OpKernelConstruction *ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("magnitude", &magnitude_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rice_b1", &rice_b1_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rice_steps", &rice_steps_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("negative_flag", &negative_flag_));
  }

  void Compute(OpKernelContext *ctx) override {
    DenormalGuard guard;
    const Tensor &update = ctx->input(0);
    const Tensor &residual = ctx->input(1);
    const int64_t n = residual.NumElements();
    const bool add = update.NumElements() != 0;
    OP_REQUIRES(ctx, !add || update.NumElements() == n,
                InvalidArgument("SbcEncode: update has ", update.NumElements(),
                                " elements, residual ", n));
    OP_REQUIRES(ctx, k_ <= n, InvalidArgument("SbcEncode: k = ", k_, " > numel = ", n));
    Tensor *a_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({1}, 0, residual.shape(), &a_t));
    float *a = a_t->flat<float>().data();
    const float *r = residual.flat<float>().data();
    if (a != r && n) std::memcpy(a, r, static_cast<size_t>(n) * sizeof(float));
    int64_t counts[2] = {0, 0};
    double sums[2] = {0.0, 0.0};
    // A = R + dW in the selection's pass. The paper rule gets a destination for k positions:
    // when the two sides' means are decisively apart the kernel writes only the winner there
    // (in_dst; its sum is the exact tree sum, the loser's a float64 sum that orders the means
    // the same way); else both sides wait in this thread's scratch for sbc_take.
    Tensor dst_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_INT64, TensorShape({magnitude_ ? 0 : k_}), &dst_t));
    int in_dst = -1;
    int64_t *dst = magnitude_ ? nullptr : dst_t.flat<int64_t>().data();
    int rc = sbc_select(a, add ? update.flat<float>().data() : nullptr, n, k_, magnitude_ ? 1 : 0,
                        counts, sums, dst, dst ? &in_dst : nullptr);
    OP_REQUIRES(ctx, rc != kNoMem, ResourceExhausted("SbcEncode: out of memory"));
    OP_REQUIRES(ctx, rc == kOk || rc == kNonFinite,
                Internal("SbcEncode: the selection rejected its arguments (", rc, ")"));
    if (rc == kNonFinite) {
      Empty(ctx, false);
      return;
    }
    // core.mean_f32 and core.choose_side: float64 division, one rounding to float32
    float mu_p = counts[0] ? static_cast<float>(sums[0] / static_cast<double>(counts[0])) : 0.0f;
    float mu_n = counts[1] ? static_cast<float>(sums[1] / static_cast<double>(counts[1])) : 0.0f;
    int side;
    float mu;
    if (mu_p >= mu_n && mu_p > 0.0f) {
      side = 0;
      mu = mu_p;
    } else if (mu_n > 0.0f) {
      side = 1;
      mu = mu_n;
    } else {
      Empty(ctx, true);
      return;
    }
    const int64_t count = counts[side];
    Tensor *pos_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({count}), &pos_t));
    int64_t *pos = pos_t->flat<int64_t>().data();
    if (in_dst >= 0) {
      OP_REQUIRES(ctx, in_dst == side,
                  Internal("SbcEncode: the kernel's side is not the chosen one"));
      if (count) std::memcpy(pos, dst, static_cast<size_t>(count) * sizeof(int64_t));
    } else {
      sbc_take(side, pos);
    }
    // wire.choose_rice_b: b* from the table, then the shortest of b*-1, b*, b*+1 (ties: smaller)
    int64_t b0 = rice_b1_;
    for (int64_t t : rice_steps_) b0 -= t <= count;
    int64_t bs[3], sq[3], nb = 0;
    for (int64_t b = b0 - 1; b <= b0 + 1; b++)
      if (b >= 0 && b <= kMaxRiceB) bs[nb++] = b;
    sbc_gap_shift_sums(pos, count, bs, nb, sq);
    int best = 0;
    int64_t best_len = -1;
    for (int j = 0; j < nb; j++) {
      int64_t len = (sq[j] + count + 7) / 8 + (count * bs[j] + 7) / 8;
      if (best_len < 0 || len < best_len) {
        best = j;
        best_len = len;
      }
    }
    const int64_t b = bs[best], ubytes = (sq[best] + count + 7) / 8, rbytes = (count * b + 7) / 8;
    Tensor *body_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({ubytes + rbytes}), &body_t));
    uint8_t *body = body_t->flat<uint8_t>().data();
    rc = sbc_rice_encode(pos, count, b, body, ubytes, body + ubytes, rbytes);
    OP_REQUIRES(ctx, rc == kOk, Internal("SbcEncode: the Rice encoder rejected its sizes"));
    const float value = side ? -mu : mu;
    sbc_add_at(a, pos, count, -value);  // the error feedback: A - sent at the sent positions
    Tensor *h_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({5}), &h_t));
    auto h = h_t->flat<int64_t>();
    h(0) = side ? negative_flag_ : 0;
    h(1) = b;
    h(2) = count;
    h(3) = ubytes;
    h(4) = static_cast<int64_t>(f32_bits(mu));
    Scalars(ctx, value, true);
  }

 private:
  // nothing is sent (no side, or A not finite): empty message parts, new_residual = A
  void Empty(OpKernelContext *ctx, bool finite) {
    Tensor *t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({5}), &t));
    t->flat<int64_t>().setZero();
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({0}), &t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({0}), &t));
    Scalars(ctx, 0.0f, finite);
  }

  void Scalars(OpKernelContext *ctx, float value, bool finite) {
    Tensor *t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({}), &t));
    t->scalar<float>()() = value;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, TensorShape({}), &t));
    t->scalar<bool>()() = finite;
  }

  int64_t k_ = 0, rice_b1_ = 0, negative_flag_ = 1;
  bool magnitude_ = false;
  std::vector<int64_t> rice_steps_;
};

REGISTER_KERNEL_BUILDER(Name("SbcEncode").Device(DEVICE_CPU), SbcEncodeOp);

// ------------------------------------------------------------------------------------------
// the message kinds of the per-message table (horovod_sbc/tensorflow/backend/table.py K_*)
// ------------------------------------------------------------------------------------------
constexpr int64_t kBinary = 0, kSigns = 1, kValues = 2, kAllSigns = 3, kAllValues = 4;

inline bool has_signs(int64_t kind) { return kind == kSigns || kind == kAllSigns; }
inline bool has_values(int64_t kind) { return kind == kValues || kind == kAllValues; }
inline bool all_positions(int64_t kind) { return kind == kAllSigns || kind == kAllValues; }

inline uint32_t load_le32(const uint8_t *p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

// ------------------------------------------------------------------------------------------
// SbcDecode
// ------------------------------------------------------------------------------------------
// columns of the per-message table (horovod_sbc/tensorflow/backend/table.py C_*), passed as attrs
REGISTER_OP("SbcDecode")
    .Input("buf: uint8")
    .Input("table: int64")
    .Output("stats: int64")
    .Output("positions: uint32")
    // [ustart, ubytes, rstart, rbytes, count, b, numel, kind, sstart, sbytes, vstart]
    .Attr("columns: list(int)")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext *c) {
      c->set_output(0, c->Matrix(c->Dim(c->input(1), 0), 8));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return tensorflow::OkStatus();
    })
    .Doc(R"doc(
Decode every message of a gathered step, whatever its kind: stats [m, 8] are the rows of
horovod_sbc.protocol.StreamStats (ones, unary_last_zero, max_q, max_r, rem_pad_nonzero, pos_max,
sign_pad_nonzero, nonfinite) and positions (uint32) hold message j's count positions at
sum(count[0..j)) when its statistics are valid (else they are unspecified: the protocol rejects
the step). The position streams of binary, SIGNS and VALUES messages are the same Rice code
(sbc_decode_batch_into); an ALL message's positions are 0..count-1. Reads only inside the byte
ranges of the table, which the host parser checked (and which are checked here once more).
)doc");

class SbcDecodeOp : public OpKernel {
 public:
  explicit SbcDecodeOp(OpKernelConstruction *ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("columns", &cols_));
    OP_REQUIRES(ctx, cols_.size() == 11, InvalidArgument("SbcDecode: 11 columns"));
  }

  void Compute(OpKernelContext *ctx) override {
    DenormalGuard guard;
    const Tensor &buf_t = ctx->input(0);
    const Tensor &table = ctx->input(1);
    OP_REQUIRES(ctx, table.dims() == 2, InvalidArgument("SbcDecode: table must be 2-D"));
    const int64_t m = table.dim_size(0), w = table.dim_size(1);
    for (int64_t c : cols_)
      OP_REQUIRES(ctx, c >= 0 && c < w, InvalidArgument("SbcDecode: bad column"));
    auto tab = table.matrix<int64_t>();
    auto at = [&](int64_t j, int i) { return tab(j, cols_[i]); };
    const uint8_t *buf = buf_t.flat<uint8_t>().data();
    const int64_t buflen = buf_t.NumElements();
    std::vector<int64_t> off(m + 1, 0);
    for (int64_t j = 0; j < m; j++) {
      const int64_t c = at(j, 4), kind = at(j, 7);
      OP_REQUIRES(ctx, c >= 0 && off[j] <= (int64_t(1) << 40) - c,
                  InvalidArgument("SbcDecode: bad count"));
      OP_REQUIRES(ctx, kind >= kBinary && kind <= kAllValues,
                  InvalidArgument("SbcDecode: bad message kind ", kind));
      OP_REQUIRES(ctx, !all_positions(kind) || c <= (int64_t(1) << 32),
                  InvalidArgument("SbcDecode: ALL message of more than 2^32 elements"));
      const int64_t sbytes = has_signs(kind) ? at(j, 9) : 0;
      const int64_t vbytes = has_values(kind) ? 4 * c : 0;
      OP_REQUIRES(ctx, InBuffer(at(j, 8), sbytes, buflen) && InBuffer(at(j, 10), vbytes, buflen),
                  InvalidArgument("SbcDecode: a sign or value stream lies outside the buffer"));
      off[j + 1] = off[j] + c;
    }
    Tensor *pos_t = nullptr, *st_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({off[m]}), &pos_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, 8}), &st_t));
    uint32_t *pos = pos_t->flat<uint32_t>().data();
    auto st = st_t->matrix<int64_t>();
    for (int64_t j = 0; j < m; j++) {
      const int64_t kind = at(j, 7), count = at(j, 4);
      int64_t raw[6] = {0, 0, 0, 0, 0, -1};
      if (all_positions(kind)) {  // no position streams: every element, in order
        for (int64_t i = 0; i < count; i++) pos[off[j] + i] = static_cast<uint32_t>(i);
      } else {
        int64_t cols[7];
        for (int i = 0; i < 7; i++) cols[i] = at(j, i);
        int rc = sbc_decode_batch_into(buf, buflen, 1, &cols[0], &cols[1], &cols[2], &cols[3],
                                       &cols[4], &cols[5], &cols[6], raw, pos + off[j]);
        OP_REQUIRES(ctx, rc == kOk,
                    Internal("SbcDecode: the decoder rejected the parsed ranges (", rc, ")"));
      }
      for (int i = 0; i < 6; i++) st(j, i) = raw[i];
      st(j, 6) = has_signs(kind) ? SignPadNonzero(buf, at(j, 8), at(j, 9), count) : 0;
      st(j, 7) = has_values(kind) ? NonFinite(buf + at(j, 10), count) : 0;
    }
  }

 private:
  static bool InBuffer(int64_t start, int64_t n, int64_t buflen) {
    return n == 0 || (start >= 0 && n > 0 && start <= buflen - n);
  }

  // protocol.StreamStats.sign_pad_nonzero: a padding bit of the last sign byte is set
  static int64_t SignPadNonzero(const uint8_t *buf, int64_t start, int64_t nbytes, int64_t count) {
    const int64_t pad = 8 * nbytes - count;
    if (nbytes <= 0 || pad <= 0 || pad >= 8) return 0;
    return (buf[start + nbytes - 1] & ((1u << pad) - 1u)) != 0;
  }

  // protocol.StreamStats.nonfinite: float32 values whose exponent bits are all ones (read as
  // bits: the value itself may be subnormal)
  static int64_t NonFinite(const uint8_t *v, int64_t count) {
    int64_t n = 0;
    for (int64_t i = 0; i < count; i++) n += (load_le32(v + 4 * i) & 0x7F800000u) == 0x7F800000u;
    return n;
  }

  std::vector<int64_t> cols_;
};

REGISTER_KERNEL_BUILDER(Name("SbcDecode").Device(DEVICE_CPU), SbcDecodeOp);

// ------------------------------------------------------------------------------------------
// SbcScatterAdd
// ------------------------------------------------------------------------------------------
REGISTER_OP("SbcScatterAdd")
    .Input("positions: uint32")
    .Input("table: int64")
    .Input("buf: uint8")         // the gathered step: sign bits and per-position values
    .Input("scale: double")      // the protocol's float64(value) * scale, rounded to float32
    .Input("bases: N * float")
    .Output("outs: N * float")
    .Attr("N: int >= 1")
    .Attr("numels: list(int)")
    .Attr("columns: list(int)")  // [tensor, count, value_bits, negative, kind, sstart, vstart]
    .Attr("zero: bool")          // outs start from zeros (bases are ignored)
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext *c) {
      std::vector<int64_t> numels;
      TF_RETURN_IF_ERROR(c->GetAttr("numels", &numels));
      for (int i = 0; i < c->num_outputs(); i++)
        c->set_output(i, c->Vector(i < static_cast<int>(numels.size()) ? numels[i] : -1));
      return tensorflow::OkStatus();
    })
    .Doc(R"doc(
outs[t] (flat, numels[t] elements) = bases[t] (or zeros: then bases may be empty) + for each
rank in rank order float32(float64(value) * scale) at that rank's positions of tensor t
(float32 adds in rank order at every element: the reference's arithmetic, IEEE subnormals
kept). A binary message adds its one signed value everywhere, a SIGNS message its value with
each position's sign bit, a VALUES message each position's own float32. The table rows are the
messages in (rank, tensor) order, the positions those of SbcDecode after the protocol accepted
the step.
)doc");

class SbcScatterAddOp : public OpKernel {
 public:
  explicit SbcScatterAddOp(OpKernelConstruction *ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("numels", &numels_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("columns", &cols_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("zero", &zero_));
    OP_REQUIRES(ctx, cols_.size() == 7, InvalidArgument("SbcScatterAdd: 7 columns"));
  }

  void Compute(OpKernelContext *ctx) override {
    DenormalGuard guard;
    const Tensor &pos_t = ctx->input(0);
    const Tensor &table = ctx->input(1);
    const Tensor &buf_t = ctx->input(2);
    const int64_t nt = static_cast<int64_t>(numels_.size());
    const double scale = ctx->input(3).scalar<double>()();
    OP_REQUIRES(ctx, ctx->num_inputs() == 4 + nt,
                InvalidArgument("SbcScatterAdd: one base per numel"));
    OP_REQUIRES(ctx, table.dims() == 2, InvalidArgument("SbcScatterAdd: table must be 2-D"));
    const int64_t m = table.dim_size(0);
    for (int64_t c : cols_)
      OP_REQUIRES(ctx, c >= 0 && c < table.dim_size(1),
                  InvalidArgument("SbcScatterAdd: bad column"));
    auto tab = table.matrix<int64_t>();
    auto at = [&](int64_t j, int i) { return tab(j, cols_[i]); };
    std::vector<float *> outs(nt);
    for (int64_t t = 0; t < nt; t++) {
      Tensor *o = nullptr;
      if (zero_) {  // zeroed below, by the scatter (chunk by chunk) or before the element loop
        OP_REQUIRES_OK(ctx, ctx->allocate_output(t, TensorShape({numels_[t]}), &o));
      } else {
        const Tensor &base = ctx->input(4 + t);
        OP_REQUIRES(ctx, base.NumElements() == numels_[t],
                    InvalidArgument("SbcScatterAdd: base ", t, " has the wrong size"));
        OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output(
                                {static_cast<int>(4 + t)}, t, TensorShape({numels_[t]}), &o));
        const float *src = base.flat<float>().data();
        if (o->flat<float>().data() != src && numels_[t])
          std::memcpy(o->flat<float>().data(), src,
                      static_cast<size_t>(numels_[t]) * sizeof(float));
      }
      outs[t] = o->flat<float>().data();
    }
    // per tensor, its messages in rank order (rows are rank-major), positions at off
    std::vector<int64_t> off(m + 1, 0);
    std::vector<bool> binary_only(nt, true);
    for (int64_t j = 0; j < m; j++) {
      off[j + 1] = off[j] + at(j, 1);
      const int64_t t = at(j, 0);
      OP_REQUIRES(ctx, t >= 0 && t < nt, InvalidArgument("SbcScatterAdd: bad tensor index"));
      if (at(j, 4) != kBinary && at(j, 1) > 0) binary_only[t] = false;
    }
    OP_REQUIRES(ctx, off[m] == pos_t.NumElements(),
                InvalidArgument("SbcScatterAdd: positions do not match the table's counts"));
    const uint32_t *pos = pos_t.flat<uint32_t>().data();
    // tensors whose messages are all binary: one value per message, the chunked scatter
    std::vector<int64_t> gstart(1, 0), g_out, g_numel, p_off, cnt;
    std::vector<float> val;
    for (int64_t t = 0; t < nt; t++) {
      if (!binary_only[t]) continue;
      for (int64_t j = 0; j < m; j++) {
        if (at(j, 0) != t) continue;
        p_off.push_back(off[j]);
        cnt.push_back(at(j, 1));
        val.push_back(Scaled(Signed(static_cast<uint32_t>(at(j, 2)), at(j, 3) != 0), scale));
      }
      gstart.push_back(static_cast<int64_t>(p_off.size()));
      g_out.push_back(reinterpret_cast<int64_t>(outs[t]));
      g_numel.push_back(numels_[t]);
    }
    const int64_t ng = static_cast<int64_t>(g_out.size());
    int rc = ng ? sbc_scatter_add_groups_from(pos, pos_t.NumElements(), ng, gstart.data(),
                                              g_out.data(), g_numel.data(), p_off.data(),
                                              cnt.data(), val.data(), zero_ ? 1 : 0)
                : kOk;
    OP_REQUIRES(ctx, rc != kNoMem, ResourceExhausted("SbcScatterAdd: out of memory"));
    OP_REQUIRES(ctx, rc == kOk,
                Internal("SbcScatterAdd: the scatter rejected its arguments (", rc, ")"));
    // tensors with SIGNS or VALUES messages: a value per position, added rank after rank
    const uint8_t *buf = buf_t.flat<uint8_t>().data();
    const int64_t buflen = buf_t.NumElements();
    for (int64_t t = 0; t < nt; t++) {
      if (binary_only[t]) continue;
      float *o = outs[t];
      if (zero_ && numels_[t]) std::memset(o, 0, static_cast<size_t>(numels_[t]) * sizeof(float));
      for (int64_t j = 0; j < m; j++) {
        if (at(j, 0) != t) continue;
        const int64_t kind = at(j, 4), count = at(j, 1);
        const int64_t sstart = at(j, 5), vstart = at(j, 6);
        OP_REQUIRES(ctx, !has_signs(kind) || (sstart >= 0 && sstart <= buflen - (count + 7) / 8),
                    InvalidArgument("SbcScatterAdd: sign stream outside the buffer"));
        OP_REQUIRES(ctx, !has_values(kind) || (vstart >= 0 && vstart <= buflen - 4 * count),
                    InvalidArgument("SbcScatterAdd: value stream outside the buffer"));
        const uint32_t *pj = pos + off[j];
        for (int64_t i = 0; i < count; i++) {
          OP_REQUIRES(ctx, pj[i] < static_cast<uint64_t>(numels_[t]),
                      InvalidArgument("SbcScatterAdd: position out of range"));
          uint32_t bits = has_values(kind) ? load_le32(buf + vstart + 4 * i)
                                           : static_cast<uint32_t>(at(j, 2));
          bool neg = at(j, 3) != 0;
          if (has_signs(kind)) neg = neg || ((buf[sstart + i / 8] >> (7 - i % 8)) & 1);
          o[pj[i]] += Scaled(Signed(bits, neg), scale);
        }
      }
    }
  }

 private:
  // wire.TensorMessage.signed_value (and a SIGNS position's sign bit): the sign bit set
  static uint32_t Signed(uint32_t bits, bool negative) {
    return negative ? bits | 0x80000000u : bits;
  }

  // the protocol's decoded arithmetic: float32(float64(value) * scale)
  static float Scaled(uint32_t bits, double scale) {
    return static_cast<float>(static_cast<double>(bits_f32(bits)) * scale);
  }

  std::vector<int64_t> numels_, cols_;
  bool zero_ = true;
};

REGISTER_KERNEL_BUILDER(Name("SbcScatterAdd").Device(DEVICE_CPU), SbcScatterAddOp);

}  // namespace
