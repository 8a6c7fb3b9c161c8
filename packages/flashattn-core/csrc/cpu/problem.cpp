#include "problem.h"

#include "mlx/allocator.h"

namespace flashattn::cpu {

namespace {

// Offsets of every (B..., H) slice of `a`, whose last two axes are the rows
// and columns of one slice. Strides are in elements and may be zero
// (broadcast masks) or arbitrary (transposed or sliced views).
StridedOperand strided_operand(const mx::array& a) {
  StridedOperand op;
  op.data = a.data<void>();
  int lead = a.ndim() - 2;
  int64_t count = 1;
  for (int d = 0; d < lead; ++d) {
    count *= a.shape(d);
  }
  op.base.resize(count);
  for (int64_t n = 0; n < count; ++n) {
    int64_t rem = n, loc = 0;
    for (int d = lead - 1; d >= 0; --d) {
      loc += (rem % a.shape(d)) * a.strides()[d];
      rem /= a.shape(d);
    }
    op.base[n] = loc;
  }
  op.row_stride = a.strides()[lead];
  op.col_stride = a.strides()[lead + 1];
  return op;
}

} // namespace

AttentionProblem describe_problem(
    const std::vector<mx::array>& inputs,
    mx::array& out,
    float scale,
    MaskKind mask_kind,
    int window,
    mx::array* lse,
    const KVQuantization& quantization) {
  const auto& q = inputs[0];
  // Keys, values and the mask, whichever arrays each takes.
  size_t next = 1;
  auto operand = [&](int bits, int group_size, Quantized& quantized) {
    const mx::array& data = inputs[next++];
    if (bits) {
      quantized = {bits, group_size, inputs[next].dtype(), strided_operand(inputs[next]),
                   strided_operand(inputs[next + 1])};
      next += 2;
    }
    return data;
  };
  AttentionProblem p;
  const mx::array& k = operand(quantization.k_bits, quantization.k_group_size, p.k_quantized);
  const mx::array& v = operand(quantization.v_bits, quantization.v_group_size, p.v_quantized);
  p.dtype = q.dtype();
  p.H_q = q.shape(-3);
  p.H_kv = k.shape(-3);
  p.L = q.shape(-2);
  p.S = k.shape(-2);
  p.E = q.shape(-1); // quantized keys and values hold E elements in fewer words
  p.batch = q.size() / (int64_t(p.H_q) * p.L * p.E);
  p.q_kv_heads_ratio = p.H_q / p.H_kv;
  p.scale = scale;
  p.mask_kind = mask_kind;
  p.window = window;
  p.q = strided_operand(q);
  p.k = strided_operand(k);
  p.v = strided_operand(v);
  if (inputs.size() > next) {
    p.mask = strided_operand(inputs[next]);
    p.mask_dtype = inputs[next].dtype();
  }
  p.out = out.data<void>();
  p.out_dtype = out.dtype();
  p.lse = lse ? lse->data<float>() : nullptr;
  return p;
}

mx::cpu::CommandEncoder& start_encoding(
    mx::Stream stream,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
  }
  return encoder;
}

} // namespace flashattn::cpu
