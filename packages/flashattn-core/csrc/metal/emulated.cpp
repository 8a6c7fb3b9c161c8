#include "metal/emulated.h"

#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace flashattn::metal {

namespace {

class EmulatedKernel : public mx::Primitive {
 public:
  EmulatedKernel(mx::Stream s, std::string instance, std::tuple<int, int, int> grid,
                 std::tuple<int, int, int> threadgroup, Emulation emulation)
      : mx::Primitive(s),
        instance_(std::move(instance)),
        grid_{unsigned(std::get<0>(grid)), unsigned(std::get<1>(grid)), unsigned(std::get<2>(grid))},
        threadgroup_{unsigned(std::get<0>(threadgroup)), unsigned(std::get<1>(threadgroup)),
                     unsigned(std::get<2>(threadgroup))},
        emulation_(emulation) {}

  // Runs the emulator right here, not as a task on the stream's thread (as
  // CPU primitives normally do), so that its errors surface from mx.eval as
  // exceptions; waiting for the stream first makes the inputs ready.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::synchronize(stream());
    std::vector<std::string> types;
    std::vector<FaEmuBuffer> buffers;
    for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
    auto add = [&](const mx::array& a, bool is_output) {
      if (!is_output && !a.flags().row_contiguous) {
        throw std::logic_error("flash_attention: emulated Metal kernels need row-contiguous inputs");
      }
      types.push_back(msl_type(a.dtype()));
      buffers.push_back({const_cast<void*>(static_cast<const void*>(a.data<char>())),
                         static_cast<int64_t>(a.size()), static_cast<int64_t>(a.nbytes()), nullptr});
    };
    for (const auto& a : inputs) add(a, false);
    for (const auto& a : outputs) add(a, true);
    for (size_t i = 0; i < buffers.size(); ++i) buffers[i].dtype = types[i].c_str();
    char error[1024] = {0};
    const int rc = emulation_.run(instance_.c_str(), buffers.data(), static_cast<int>(inputs.size()),
                                  static_cast<int>(outputs.size()), grid_, threadgroup_, emulation_.lane_order,
                                  emulation_.seed, error, sizeof error);
    if (rc != 0) {
      throw std::runtime_error("Metal emulator, " + instance_ + ": " + error);
    }
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("flash_attention: emulated Metal kernels run on the CPU stream");
  }

  const char* name() const override {
    return "EmulatedMetalKernel";
  }

 private:
  std::string instance_;
  unsigned grid_[3];
  unsigned threadgroup_[3];
  Emulation emulation_;
};

}  // namespace

Launcher emulated_launcher(Emulation emulation, mx::Stream s) {
  return [emulation, s](const KernelCall& call) {
    std::vector<mx::array> inputs;
    for (const auto& a : call.inputs) inputs.push_back(mx::contiguous(a, false, s));
    return mx::array::make_arrays(
        call.output_shapes, call.output_dtypes,
        std::make_shared<EmulatedKernel>(s, instance_name(call.kernel, call.template_args), call.grid,
                                         call.threadgroup, emulation),
        inputs);
  };
}

}  // namespace flashattn::metal
