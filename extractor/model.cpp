// model.cpp — the libtorch shim behind the model section of extractor.h: load, probe and run a staged model.
//
// Every exported function is noexcept and turns every C++ exception into a hapifs code and a
// one-line message in the caller's hapi_error. Each stage is kept as its own TorchScript module
// (the top module's named children), so any prefix [0, split) runs without the rest; with
// optimize, each stage is frozen and optimized separately, because a frozen top module inlines
// its children and loses them.

#include "extractor.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>
#include <c10/core/InferenceMode.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/cuda.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/fold_conv_bn.h>
#include <torch/csrc/jit/passes/quantization/finalize.h>
#include <torch/csrc/jit/passes/quantization/insert_observers.h>
#include <torch/csrc/jit/passes/quantization/insert_quant_dequant.h>
#include <torch/script.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

struct hapi_model {
    std::string metadata;                    // hapifs.json, verbatim
    std::vector<torch::jit::Module> stages;  // in execution order
    std::vector<hapi_stage_info> info;       // names from load, shapes from probe
    std::vector<torch::ScalarType> stage_precision;  // what each stage computes in
    // A bf16 model's stages in fp32, as loaded, from the load to the first probe's check; an
    // int8 model's, from the load to its calibration (hapi_model_calibrate)
    std::vector<torch::jit::Module> reference;
    bool int8 = false;        // precision int8: stages quantized at calibration
    bool calibrated = false;
    // Of an int8 model: chain[i] when stages i and i + 1 both run in int8 and pass the
    // quantized tensor between them (no dequantize and quantize at the boundary: libtorch
    // 1.13 without FBGEMM does those a value at a time); then chained[i] holds stage i's
    // variants taking a quantized input (bit 0 of the index) and/or returning one (bit 1).
    std::vector<bool> chain;
    std::vector<std::array<torch::jit::Module, 4>> chained;
    c10::Device device{c10::kCPU};
    torch::ScalarType precision = torch::kFloat;  // the model's: its stages' but where checked
    bool optimize = false;
    bool probed = false;
    int64_t channels = 0, height = 0, width = 0;  // probed input shape of one sample
};

namespace {

const char kMetadataName[] = "hapifs.json";

// ATen's own kernels (everything outside oneDNN: elementwise ops, reductions, layer norm) are
// built for AVX2 and AVX512, and libtorch 1.13 takes the AVX512 ones only when
// ATEN_CPU_CAPABILITY=avx512 asks for them. Asked for here, at load, before any kernel runs
// (the variable is read at the first), when the CPU has what they need (libtorch does not
// check: elsewhere they would fault) and the environment does not choose. Measured in
// docs/design.md ("bf16 on the CPU").
struct AvxCapability {
    AvxCapability()
    {
        __builtin_cpu_init();
        if (!std::getenv("ATEN_CPU_CAPABILITY") && __builtin_cpu_supports("avx512f") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
            setenv("ATEN_CPU_CAPABILITY", "avx512", 0);
    }
} avx_capability;

// libtorch's interop pool can be sized once per process, before it starts.
std::once_flag interop_once;

// TorchScript interpreter errors span many lines (a TorchScript traceback, then the original
// error on the last line); other c10 errors put the message first. Keep the informative line.
std::string one_line(const char *what)
{
    std::string s(what ? what : "unknown error");
    std::vector<std::string> lines;
    size_t start = 0;
    while (start <= s.size()) {
        size_t end = s.find('\n', start);
        if (end == std::string::npos)
            end = s.size();
        std::string line = s.substr(start, end - start);
        size_t first = line.find_first_not_of(" \t\r");
        if (first != std::string::npos)
            lines.push_back(line.substr(first));
        start = end + 1;
    }
    if (lines.empty())
        return "unknown error";
    if (lines.size() > 1 && lines.front().rfind("The following operation failed", 0) == 0)
        return lines.back();
    return lines.front();
}

bool is_oom_message(const std::string &msg)
{
    return msg.find("not enough memory") != std::string::npos ||
           msg.find("out of memory") != std::string::npos;
}

// Maps a caught c10::Error to a code: allocation failures (CPU allocator errors are plain
// c10::Errors in 1.13) become HAPI_EOOM so the caller can retry with a smaller batch.
int error_from_c10(const c10::Error &e, int fallback, const char *what_failed, hapi_error *err)
{
    std::string msg = one_line(e.what_without_backtrace());
    int code = (dynamic_cast<const c10::OutOfMemoryError *>(&e) || is_oom_message(msg)) ? HAPI_EOOM
                                                                                      : fallback;
    return hapi_error_set(err, code, "%s: %s", what_failed, msg.c_str());
}

// An error from a stage's forward that is not a c10::Error; out-of-memory shows in its text.
int stage_error(const std::runtime_error &e, const char *stage, hapi_error *err)
{
    std::string msg = one_line(e.what());
    return hapi_error_set(err, is_oom_message(msg) ? HAPI_EOOM : HAPI_EMODEL, "stage %s: %s", stage,
                          msg.c_str());
}

// True if path is a zip archive with TorchScript's records: tells "not a TorchScript archive"
// apart from "a TorchScript archive that libtorch failed to load" after a failed load.
bool looks_like_torchscript(const char *path)
{
    try {
        caffe2::serialize::PyTorchStreamReader reader(path);
        return reader.hasRecord("constants.pkl") && reader.hasRecord("data.pkl");
    } catch (...) {
        return false;
    }
}

void configure_threads(int threads)
{
    if (threads <= 0)
        return;
    at::set_num_threads(threads);
    std::call_once(interop_once, [threads] {
        try {
            at::set_num_interop_threads(threads);
        } catch (const c10::Error &) {
            // The pool already started (someone else ran parallel work first): keep it.
        }
    });
}

extern "C" void hapi_model_set_threads(int n)
{
    if (n >= 1)
        omp_set_num_threads(n); // the calling thread's own count: at::parallel_for and oneDNN read it
}

// A batch as stage i takes it: on the model's device, in the stage's precision. A bf16 stage
// gets channels-last maps, the layout oneDNN's bf16 convolutions run in without reorders
// (other shapes, a ViT's tokens, as they are). Between stages of one precision: as it is.
torch::Tensor stage_input(const hapi_model *m, size_t i, torch::Tensor x)
{
    if (!m->device.is_cpu())
        x = x.to(m->device);
    torch::ScalarType p = m->stage_precision[i];
    if (x.scalar_type() != p) {
        x = x.to(p);
        if (p != torch::kFloat && x.dim() == 4)
            x = x.contiguous(at::MemoryFormat::ChannelsLast);
    }
    return x;
}

// Casts a stage's floating-point weights and buffers to bf16 in place, 4-D ones (convolution
// kernels) channels-last, before freeze() turns them into constants: the frozen graph then
// folds batch-norm and picks oneDNN's bf16 kernels on them.
void to_bf16(torch::jit::Module &stage)
{
    for (const auto &p : stage.named_parameters(true)) {
        torch::Tensor t = p.value;
        if (!t.is_floating_point())
            continue;
        torch::Tensor c = t.to(torch::kBFloat16);
        if (c.dim() == 4)
            c = c.contiguous(at::MemoryFormat::ChannelsLast);
        t.set_data(c);
    }
    for (const auto &b : stage.named_buffers(true)) {
        torch::Tensor t = b.value;
        if (t.is_floating_point())
            t.set_data(t.to(torch::kBFloat16));
    }
}

// Whether a frozen graph (its blocks too) holds an activation that libtorch 1.13's
// optimize_for_inference() would run in place on a oneDNN tensor (prim::MKLDNNHardSwish_,
// MKLDNNHardSigmoid_, MKLDNNHardTanh_): it gets the channels of a last partial block of 16
// wrong (C % 16 != 0). Measured after a 1x1 convolution to 24 channels: channels 16-23 off by
// up to 1.4 of 1.6 (Hardswish), 2.1 of 0.9 (Hardsigmoid), 2.0 of 2.3 (ReLU6); MobileNetV3's
// features at its pooling stage at cosine 0.91 of eager. ReLU, SiLU, GELU, sigmoid are right.
bool has_mkldnn_unsafe_activation(const torch::jit::Block *block)
{
    static const char *const unsafe[] = { "aten::hardswish", "aten::hardswish_",
                                          "aten::hardsigmoid", "aten::hardsigmoid_",
                                          "aten::hardtanh", "aten::hardtanh_",
                                          "aten::relu6", "aten::relu6_" };
    for (const torch::jit::Node *n : block->nodes()) {
        for (const char *kind : unsafe)
            if (std::strcmp(n->kind().toQualString(), kind) == 0)
                return true;
        for (const torch::jit::Block *b : n->blocks())
            if (has_mkldnn_unsafe_activation(b))
                return true;
    }
    return false;
}

// What libtorch 1.13 leaves slow in a frozen bf16 stage on the CPU, moved to kernels that are
// not (docs/design.md, "Where bf16 time goes"):
// - a convolution runs through aten::conv2d, which reorders its weights into oneDNN's blocked
//   layout on every call, and the ReLU after it is a separate pass over the map in ATen's
//   bf16 code, which is slow: ResNet-50's ReLUs and residual adds took half of a bf16 batch.
//   Each convolution with constant weights becomes mkldnn_prepacked::conv2d_run on weights
//   packed once here, a ReLU that is its only reader fused into it as oneDNN's post-op (the
//   same arithmetic: bit-equal to conv2d then relu on every shape tried);
// - aten::layer_norm in bf16 is 10-18x slower than in fp32: it runs in fp32 between two casts
//   (more exact too; the result is rounded to the input's type once).
void rewrite_bf16_block(torch::jit::Graph &g, torch::jit::Block *block)
{
    using namespace torch::jit;
    static const c10::Symbol conv2d = c10::Symbol::fromQualString("aten::conv2d");
    static const c10::Symbol relu = c10::Symbol::fromQualString("aten::relu");
    static const c10::Symbol relu_ = c10::Symbol::fromQualString("aten::relu_");
    static const c10::Symbol layer_norm = c10::Symbol::fromQualString("aten::layer_norm");
    static const c10::Symbol to = c10::Symbol::fromQualString("aten::to");
    static const c10::Symbol conv_run = c10::Symbol::fromQualString("mkldnn_prepacked::conv2d_run");
    // absent from a libtorch built without oneDNN: convolutions then stay as they are
    static const c10::optional<c10::OperatorHandle> prepack =
        c10::Dispatcher::singleton().findSchema({"mkldnn_prepacked::conv2d_prepack", ""});

    for (auto it = block->nodes().begin(); it != block->nodes().end();) {
        Node *n = *it;
        ++it;
        for (Block *b : n->blocks())
            rewrite_bf16_block(g, b);
        if (n->kind() == conv2d && n->inputs().size() == 7 && prepack) {
            c10::optional<c10::IValue> w = toIValue(n->input(1)), b = toIValue(n->input(2));
            c10::optional<c10::IValue> stride = toIValue(n->input(3)), pad = toIValue(n->input(4));
            c10::optional<c10::IValue> dil = toIValue(n->input(5)), groups = toIValue(n->input(6));
            // constant weights only, and the int-list padding (not "same"/"valid")
            if (!w || !w->isTensor() || w->toTensor().dim() != 4 ||
                w->toTensor().scalar_type() != torch::kBFloat16 || !b ||
                !(b->isNone() || b->isTensor()) || !stride || !stride->isIntList() || !pad ||
                !pad->isIntList() || !dil || !dil->isIntList() || !groups || !groups->isInt())
                continue;
            Node *act = nullptr;
            const auto &uses = n->output()->uses();
            if (uses.size() == 1 && (uses[0].user->kind() == relu || uses[0].user->kind() == relu_) &&
                uses[0].user->owningBlock() == block)
                act = uses[0].user;
            torch::Tensor wt = w->toTensor();
            std::vector<int64_t> dv = dil->toIntVector();
            // The input size only steers oneDNN's choice of weight layout (measured: no
            // difference between the real one and this); any batch and size run.
            std::vector<int64_t> in_size{1, wt.size(1) * groups->toInt(),
                                         std::max<int64_t>(32, dv[0] * (wt.size(2) - 1) + 1),
                                         std::max<int64_t>(32, dv[dv.size() > 1] * (wt.size(3) - 1) + 1)};
            torch::jit::Stack stack{wt, *b, *stride, *pad, *dil, *groups, c10::IValue(in_size),
                                    std::string(act ? "relu" : "none")};
            prepack->callBoxed(&stack);
            WithInsertPoint guard(n);
            Value *ctx = g.insertConstant(stack.at(0));
            Value *y = g.insert(conv_run, {n->input(0), ctx});
            if (act) {
                if (it != block->nodes().end() && *it == act)
                    ++it;
                act->output()->replaceAllUsesWith(y);
                act->destroy();
            }
            n->output()->replaceAllUsesWith(y);
            n->destroy();
        } else if (n->kind() == layer_norm && n->inputs().size() == 6) {
            c10::optional<c10::IValue> w = toIValue(n->input(2)), b = toIValue(n->input(3));
            if (!w || !b || !(w->isNone() || w->isTensor()) || !(b->isNone() || b->isTensor()))
                continue;
            WithInsertPoint guard(n);
            auto fp32 = [&](const c10::IValue &v) {
                return v.isNone() ? g.insertConstant(v)
                                  : g.insertConstant(v.toTensor().to(torch::kFloat));
            };
            Value *x = g.insert(to, {n->input(0), c10::IValue(torch::kFloat)});
            Value *y = g.insert(layer_norm, {x, n->input(1), fp32(*w), fp32(*b), n->input(4),
                                             n->input(5)});
            // back to the input's own type (bf16 but where a model casts)
            Value *dtype = g.insert(c10::Symbol::fromQualString("prim::dtype"), {n->input(0)});
            Value *out = g.insert(to, {y, dtype});
            n->output()->replaceAllUsesWith(out);
            n->destroy();
        }
    }
}

// A stage as it will run: cast to bf16 where asked; with optimize, frozen (batch-norm folded,
// attributes inlined), then optimized for inference unless that would compute an activation
// wrong, then a bf16 stage's slow ops moved (rewrite_bf16_block). Takes the stage's module
// over: a bf16 cast changes its weights in place.
torch::jit::Module prepare_stage(torch::jit::Module stage, torch::ScalarType precision,
                                 bool optimize, const c10::Device &device)
{
    if (precision == torch::kBFloat16)
        to_bf16(stage);
    if (!optimize)
        return stage;
    stage = torch::jit::freeze(stage);
    // fp32 only: a bf16 graph gets no oneDNN tensors (see the function)
    if (precision != torch::kFloat ||
        !has_mkldnn_unsafe_activation(stage.get_method("forward").graph()->block()))
        stage = torch::jit::optimize_for_inference(stage);
    if (precision == torch::kBFloat16 && device.is_cpu()) {
        std::shared_ptr<torch::jit::Graph> g = stage.get_method("forward").graph();
        rewrite_bf16_block(*g, g->block());
    }
    return stage;
}

int64_t sample_elements(const hapi_stage_info &info)
{
    int64_t n = 1;
    for (int i = 0; i < info.ndim; i++)
        n *= info.shape[i];
    return n;
}

int model_load(const char *path, const hapi_model_options *opt, hapi_model **out, hapi_error *err)
{
    struct stat st;
    if (access(path, R_OK) != 0 || stat(path, &st) != 0) {
        int e = errno;
        return hapi_error_set(err, -e, "%s: %s", path, strerror(e));
    }
    if (S_ISDIR(st.st_mode))
        return hapi_error_set(err, -EISDIR, "%s: is a directory, not a model archive", path);

    const char *device_name = opt && opt->device && *opt->device ? opt->device : "cpu";
    c10::optional<c10::Device> device;
    try {
        device = c10::Device(device_name);
    } catch (const c10::Error &) {
        return hapi_error_set(err, HAPI_EINVAL, "device '%s': not cpu or cuda[:N]", device_name);
    }
    if (device->is_cuda() && !torch::cuda::is_available())
        return hapi_error_set(err, HAPI_EINVAL, "device '%s': CUDA is not available", device_name);
    int precision = opt ? opt->precision : HAPI_PRECISION_FP32;
    if (precision != HAPI_PRECISION_FP32 && precision != HAPI_PRECISION_BF16 &&
        precision != HAPI_PRECISION_INT8)
        return hapi_error_set(err, HAPI_EINVAL, "unknown precision %d", precision);
    if (precision != HAPI_PRECISION_FP32 && !device->is_cpu())
        return hapi_error_set(err, HAPI_EINVAL, "precision %s runs on the CPU only (device '%s')",
                              hapi_precision_name(precision), device_name);
    if (precision == HAPI_PRECISION_INT8) {
        const auto &engines = at::globalContext().supportedQEngines();
        if (std::find(engines.begin(), engines.end(), at::QEngine::ONEDNN) == engines.end())
            return hapi_error_set(err, HAPI_EINVAL,
                                  "precision int8: this libtorch has no oneDNN quantized engine");
    }
    configure_threads(opt ? opt->threads : 0);

    torch::jit::ExtraFilesMap extra{{kMetadataName, ""}};
    torch::jit::Module top;
    try {
        top = torch::jit::load(path, device, extra);
    } catch (const c10::Error &e) {
        if (!looks_like_torchscript(path))
            return hapi_error_set(err, HAPI_ENOTSTAGED, "%s: not a TorchScript archive", path);
        return error_from_c10(e, HAPI_EMODEL, path, err);
    }
    if (extra[kMetadataName].empty())
        return hapi_error_set(err, HAPI_ENOTSTAGED,
                              "%s: TorchScript archive without %s "
                              "(export it with hapifs-export-model)",
                              path, kMetadataName);

    auto m = std::make_unique<hapi_model>();
    m->metadata = extra[kMetadataName];
    m->device = *device;
    m->precision = precision == HAPI_PRECISION_BF16 ? torch::kBFloat16 : torch::kFloat;
    m->int8 = precision == HAPI_PRECISION_INT8;
    bool optimize = opt && opt->optimize;
    m->optimize = optimize;
    top.eval();
    for (const auto &child : top.named_children()) {
        hapi_stage_info info{};
        if (child.name.size() >= sizeof(info.name))
            return hapi_error_set(err, HAPI_ENOTSTAGED, "%s: stage name '%.40s...' is too long",
                                  path, child.name.c_str());
        if (!child.value.find_method("forward"))
            return hapi_error_set(err, HAPI_ENOTSTAGED, "%s: stage '%s' has no forward method",
                                  path, child.name.c_str());
        std::memcpy(info.name, child.name.c_str(), child.name.size() + 1);
        torch::jit::Module stage = child.value;
        // Weights are counted before freezing turns them into constants.
        for (const auto &t : stage.parameters())
            info.param_bytes += (uint64_t)t.numel() * t.element_size();
        for (const auto &t : stage.buffers())
            info.param_bytes += (uint64_t)t.numel() * t.element_size();
        stage.eval();
        // the first probe checks bf16 against these (model_check_bf16)
        if (m->precision == torch::kBFloat16 || m->int8)
            m->reference.push_back(stage.deepcopy());
        // an int8 model runs in fp32 until its calibration quantizes its stages
        info.precision = m->int8 ? HAPI_PRECISION_FP32 : precision;
        m->stages.push_back(prepare_stage(stage, m->precision, optimize, m->device));
        m->stage_precision.push_back(m->precision);
        m->info.push_back(info);
    }
    if (m->stages.empty())
        return hapi_error_set(err, HAPI_ENOTSTAGED,
                              "%s: the top module has no child modules (stages)", path);
    *out = m.release();
    return 0;
}

// The lowest cosine of a sample of a against the same sample of b (same shapes, batch first),
// summed in double; 1 where both are zero.
double min_cosine(const torch::Tensor &a, const torch::Tensor &b)
{
    torch::Tensor x = a.cpu().to(torch::kDouble).reshape({a.size(0), -1});
    torch::Tensor y = b.cpu().to(torch::kDouble).reshape({b.size(0), -1});
    double lowest = 1.0;
    for (int64_t k = 0; k < x.size(0); k++) {
        double dot = (x[k] * y[k]).sum().item<double>();
        double nx = x[k].norm().item<double>(), ny = y[k].norm().item<double>();
        double c = nx > 0 && ny > 0 ? dot / (nx * ny) : (nx == ny ? 1.0 : 0.0);
        lowest = std::min(lowest, c);
    }
    return lowest;
}

// Runs stage i of a probe or check on x, its errors named.
int run_stage(torch::jit::Module &stage, const hapi_stage_info &info, const torch::Tensor &x,
              torch::jit::IValue *y, hapi_error *err)
{
    try {
        *y = stage.forward({x});
    } catch (const c10::Error &e) {
        std::string what = std::string("stage ") + info.name;
        return error_from_c10(e, HAPI_EMODEL, what.c_str(), err);
    } catch (const std::runtime_error &e) {
        // The TorchScript interpreter rethrows an op's error as a runtime_error.
        return stage_error(e, info.name, err);
    }
    if (!y->isTensor())
        return hapi_error_set(err, HAPI_EMODEL, "stage %s returned a %s, not a tensor", info.name,
                              y->tagKind().c_str());
    return 0;
}

// The check of a bf16 model (HAPI_BF16_MIN_COSINE in extractor.h), on the first probe: two
// seeded image-like samples (smooth noise at a sixteenth of the size, bilinearly enlarged,
// with a little fine noise: a normalized photo's range and spectrum, roughly) run through the
// fp32 reference once, and through the model as it will run. While some stage's output is
// below the bound against the reference's, the first such stage moves to fp32 if it runs in
// bf16, else the last bf16 stage before it does (a later stage may magnify an earlier one's
// rounding: Swin V2's does), and the model runs again from the moved stage. Fills info's
// precision and check_cosine; commits only when it succeeds.
int model_check_bf16(hapi_model *m, std::vector<hapi_stage_info> &info, hapi_error *err)
{
    size_t n = m->stages.size();
    std::vector<torch::jit::Module> stages = m->stages;
    std::vector<torch::ScalarType> precision = m->stage_precision;
    std::vector<torch::Tensor> want(n), in(n + 1);  // the reference's outputs; the model's
    c10::InferenceMode guard;
    {
        at::Generator gen = at::detail::createCPUGenerator(20261207);
        int64_t h = m->height, w = m->width;
        torch::Tensor coarse = torch::randn({2, m->channels, h / 16 + 2, w / 16 + 2}, gen,
                                            torch::kFloat);
        in[0] = at::upsample_bilinear2d(coarse, {h, w}, false) +
                0.1 * torch::randn({2, m->channels, h, w}, gen, torch::kFloat);
        if (!m->device.is_cpu())
            in[0] = in[0].to(m->device);
    }
    torch::Tensor x = in[0];
    for (size_t i = 0; i < n; i++) {
        torch::jit::IValue y;
        int rc = run_stage(m->reference[i], info[i], x, &y, err);
        if (rc < 0)
            return rc;
        x = want[i] = y.toTensor().to(torch::kFloat);
    }
    for (size_t from = 0;;) {
        size_t low = n;
        for (size_t i = from; i < n && low == n; i++) {
            torch::Tensor x = in[i].to(precision[i]);
            if (precision[i] != torch::kFloat && x.dim() == 4)
                x = x.contiguous(at::MemoryFormat::ChannelsLast);
            torch::jit::IValue y;
            int rc = run_stage(stages[i], info[i], x, &y, err);
            if (rc < 0)
                return rc;
            in[i + 1] = y.toTensor();
            info[i].check_cosine = min_cosine(in[i + 1], want[i]);
            if (info[i].check_cosine < HAPI_BF16_MIN_COSINE)
                low = i;
        }
        size_t move = low;
        while (move < n && precision[move] == torch::kFloat)
            move = move ? move - 1 : n;  // the last bf16 stage at or before low, if any
        if (move == n)
            break;  // every stage right, or those below the bound in fp32 from the start
        {
            c10::InferenceMode off(false);  // frozen weights are ordinary tensors
            stages[move] = prepare_stage(m->reference[move], torch::kFloat, m->optimize,
                                         m->device);
        }
        precision[move] = torch::kFloat;
        info[move].precision = HAPI_PRECISION_FP32;
        from = move;
    }
    m->stages = std::move(stages);
    m->stage_precision = std::move(precision);
    m->reference.clear();
    return 0;
}

// A min-max observer in TorchScript, of the kind the graph-mode quantization passes call:
// forward() keeps the range of what passes through, calculate_qparams() turns it into a scale
// and a zero point. Activations: per tensor, quint8 over [0, 255], affine; weights: per output
// channel (axis 0), qint8, symmetric, the zero point 0 that oneDNN's int8 kernels take.
torch::jit::Module make_observer(bool weight)
{
    torch::jit::Module obs(weight ? "__torch__.hapi.WeightObserver" : "__torch__.hapi.ActObserver");
    obs.register_attribute("dtype", c10::IntType::get(),
                           (int64_t)(weight ? c10::kQInt8 : c10::kQUInt8));
    obs.register_attribute("qscheme", c10::IntType::get(),
                           (int64_t)(weight ? c10::kPerChannelSymmetric : c10::kPerTensorAffine));
    obs.register_attribute("ch_axis", c10::IntType::get(), (int64_t)0);
    obs.register_attribute("min_val", c10::TensorType::get(), torch::empty({0}));
    obs.register_attribute("max_val", c10::TensorType::get(), torch::empty({0}));
    obs.register_attribute("per_channel", c10::BoolType::get(), weight);
    obs.define(R"(
def forward(self, x: Tensor) -> Tensor:
    if x.numel() == 0:
        return x
    d = x.detach().float()
    if self.per_channel:
        lo = torch.amin(d.flatten(1), 1)
        hi = torch.amax(d.flatten(1), 1)
    else:
        lo = torch.min(d).reshape([1])
        hi = torch.max(d).reshape([1])
    if self.min_val.numel() == 0:
        self.min_val = lo
        self.max_val = hi
    else:
        self.min_val = torch.min(lo, self.min_val)
        self.max_val = torch.max(hi, self.max_val)
    return x

def calculate_qparams(self) -> Tuple[Tensor, Tensor]:
    if self.min_val.numel() == 0:
        return torch.ones([1]), torch.zeros([1]).long()
    lo = torch.clamp(self.min_val, max=0.0)
    hi = torch.clamp(self.max_val, min=0.0)
    if self.per_channel:
        scale = torch.clamp(torch.max(-lo, hi) / 127.5, min=1.1920929e-07)
        return scale, torch.zeros_like(scale).long()
    scale = torch.clamp((hi - lo) / 255.0, min=1.1920929e-07)
    return scale, torch.clamp(torch.round(-lo / scale), 0, 255).long()
)");
    return obs;
}

// Whether a graph (its blocks too) runs some quantized op.
bool runs_quantized(const torch::jit::Block *block)
{
    for (const torch::jit::Node *n : block->nodes()) {
        if (std::strncmp(n->kind().toQualString(), "quantized::", 11) == 0)
            return true;
        for (const torch::jit::Block *b : n->blocks())
            if (runs_quantized(b))
                return true;
    }
    return false;
}

// Stage `stage` (fp32, as loaded) quantized with libtorch's graph-mode passes: batch-norm
// folded into the convolutions, observers inserted, run on x (the stage's fp32 inputs, in
// batches of 8), then quantize and dequantize ops put in and fused into oneDNN's int8 kernels
// (quantized::conv2d_relu, add_relu, linear, ...), frozen. What the passes cannot quantize
// stays fp32 inside the stage; its input and output stay fp32. Throws what the passes throw.
torch::jit::Module quantize_stage(const torch::jit::Module &stage, const torch::Tensor &x)
{
    using namespace torch::jit;
    Module q = FoldConvBatchNorm(stage.deepcopy());
    QConfigDict qconfig{{"", std::make_tuple(make_observer(false), make_observer(true))}};
    q = InsertObservers(q, "forward", qconfig, true, QuantType::STATIC);
    for (int64_t at = 0; at < x.size(0); at += 8)
        q.forward({x.slice(0, at, std::min<int64_t>(at + 8, x.size(0)))});
    q = InsertQuantDeQuant(q, "forward", true, false, QuantType::STATIC);
    return Finalize(q, QuantType::STATIC, {});
}

// The node quantizing a stage's input (aten::quantize_per_tensor, its only user), or null.
torch::jit::Node *input_quantize(const std::shared_ptr<torch::jit::Graph> &g)
{
    static const c10::Symbol quantize = c10::Symbol::fromQualString("aten::quantize_per_tensor");
    if (g->inputs().size() != 2 || g->inputs()[1]->uses().size() != 1)
        return nullptr;
    torch::jit::Node *n = g->inputs()[1]->uses()[0].user;
    return n->kind() == quantize && n->inputs().size() == 4 && n->input(0) == g->inputs()[1]
               ? n : nullptr;
}

// The node dequantizing what a stage returns (aten::dequantize), or null.
torch::jit::Node *output_dequantize(const std::shared_ptr<torch::jit::Graph> &g)
{
    static const c10::Symbol dequantize = c10::Symbol::fromQualString("aten::dequantize");
    if (g->outputs().size() != 1)
        return nullptr;
    torch::jit::Node *n = g->outputs()[0]->node();
    return n->kind() == dequantize && n->inputs().size() == 1 &&
                   g->outputs()[0]->uses().size() == 1
               ? n : nullptr;
}

// A copy of quantized stage q that takes its input quantized (in) and/or returns its output
// quantized (out): the boundary's quantize or dequantize node left out.
torch::jit::Module stage_variant(const torch::jit::Module &q, bool in, bool out)
{
    torch::jit::Module v = q.clone();
    std::shared_ptr<torch::jit::Graph> g = v.get_method("forward").graph();
    if (torch::jit::Node *n = in ? input_quantize(g) : nullptr) {
        n->output()->replaceAllUsesWith(g->inputs()[1]);
        n->destroy();
    }
    if (torch::jit::Node *n = out ? output_dequantize(g) : nullptr) {
        g->return_node()->replaceInput(0, n->input(0));
        n->destroy();
    }
    return v;
}

// Chains the int8 stages i, i + 1 of quantized where it can (hapi_model.chain): stage i + 1's
// input is quantized with the scale and zero point of stage i's output (run on x, fp32's input
// to stage i), so that passing the quantized tensor on computes what dequantizing and
// quantizing again would; returns whether it could.
bool chain_stages(torch::jit::Module &a, torch::jit::Module &b, const torch::Tensor &x)
{
    std::shared_ptr<torch::jit::Graph> gb = b.get_method("forward").graph();
    torch::jit::Node *n = input_quantize(gb);
    if (!n || !output_dequantize(a.get_method("forward").graph()))
        return false;
    torch::jit::Module a_out = stage_variant(a, false, true);
    torch::jit::IValue y = a_out.forward({x.slice(0, 0, 1)});
    if (!y.isTensor() || !y.toTensor().is_quantized() ||
        y.toTensor().qscheme() != c10::kPerTensorAffine ||
        y.toTensor().scalar_type() != c10::kQUInt8)
        return false;
    torch::jit::WithInsertPoint guard(n);
    n->replaceInput(1, gb->insertConstant(y.toTensor().q_scale()));
    n->replaceInput(2, gb->insertConstant(y.toTensor().q_zero_point()));
    return true;
}

// The calibration of an int8 model (hapi_model_calibrate): every stage quantized on fp32's
// inputs to it for all the samples (a stage the passes cannot quantize, or with nothing to
// quantize, stays fp32); then, on the first kCheckSamples of them, the model as it will run
// against fp32 stage by stage, and while some stage's features are below HAPI_INT8_MIN_COSINE
// (stage at's below bound_at too),
// a stage moves to fp32: that one if it runs in int8, else the last int8 stage before it (a
// later stage may magnify an earlier one's rounding: ViT's final norm and class token do), and
// the model runs again from it. Fills info's precision and check_cosine; commits only when it
// succeeds.
int model_calibrate_int8(hapi_model *m, const torch::Tensor &samples, double bound_at, int at,
                         hapi_error *err)
{
    const int64_t kCheckSamples = 8;
    size_t n = m->stages.size();
    std::vector<torch::jit::Module> stages = m->stages, quantized(n);
    std::vector<hapi_stage_info> info = m->info;
    std::vector<torch::Tensor> want(n), in(n + 1);  // fp32's outputs; the model's inputs
    std::vector<bool> int8(n, false);
    torch::NoGradGuard no_grad;
    at::globalContext().setQEngine(at::QEngine::ONEDNN);
    torch::Tensor x = samples;  // fp32's input to stage i, every sample
    for (size_t i = 0; i < n; i++) {
        try {
            torch::jit::Module q = quantize_stage(m->reference[i], x);
            if (runs_quantized(q.get_method("forward").graph()->block())) {
                quantized[i] = q;
                int8[i] = true;
            }
        } catch (const std::exception &) {
            // the passes cannot quantize what the stage holds: it runs in fp32
        }
        torch::jit::IValue y;
        int rc = run_stage(stages[i], info[i], x, &y, err);
        if (rc < 0)
            return rc;
        x = y.toTensor();
        want[i] = x.slice(0, 0, std::min(kCheckSamples, x.size(0)));
    }
    // consecutive int8 stages pass quantized tensors on (chain_stages), from the check on
    std::vector<bool> chain(n, false);
    for (size_t i = 0; i + 1 < n; i++)
        if (int8[i] && int8[i + 1]) {
            try {
                chain[i] = chain_stages(quantized[i], quantized[i + 1], i ? want[i - 1] : samples);
            } catch (const std::exception &) {
                chain[i] = false;  // each runs on its own, dequantized between
            }
        }
    in[0] = samples.slice(0, 0, std::min(kCheckSamples, samples.size(0)));
    for (size_t from = 0;;) {
        size_t low = n;
        for (size_t i = from; i < n && low == n; i++) {
            torch::jit::IValue y;
            int rc = run_stage(int8[i] ? quantized[i] : stages[i], info[i], in[i], &y, err);
            if (rc < 0)
                return rc;
            in[i + 1] = y.toTensor();
            // an fp32 stage on fp32 inputs computes fp32's features: 0, as fp32 models report
            bool exact = !int8[i] && std::find(int8.begin(), int8.begin() + i, true) ==
                                         int8.begin() + i;
            info[i].check_cosine = exact ? 0.0 : min_cosine(in[i + 1], want[i]);
            double bound = (int)i == at ? std::max(bound_at, HAPI_INT8_MIN_COSINE)
                                        : HAPI_INT8_MIN_COSINE;
            if (!exact && info[i].check_cosine < bound)
                low = i;
        }
        size_t move = low;
        while (move < n && !int8[move])
            move = move ? move - 1 : n;  // the last int8 stage at or before low, if any
        if (move == n)
            break;  // every stage right, or no int8 stage left to move
        int8[move] = false;
        from = move;
    }
    std::vector<std::array<torch::jit::Module, 4>> chained(n);
    for (size_t i = 0; i < n; i++) {
        if (int8[i])
            stages[i] = quantized[i];
        info[i].precision = int8[i] ? HAPI_PRECISION_INT8 : HAPI_PRECISION_FP32;
        chain[i] = chain[i] && int8[i] && int8[i + 1];
    }
    for (size_t i = 0; i < n; i++) {
        bool in_q = i > 0 && chain[i - 1], out_q = chain[i];
        chained[i][0] = stages[i];
        if (in_q)
            chained[i][1] = stage_variant(stages[i], true, false);
        if (out_q)
            chained[i][2] = stage_variant(stages[i], false, true);
        if (in_q && out_q)
            chained[i][3] = stage_variant(stages[i], true, true);
    }
    m->chain = std::move(chain);
    m->chained = std::move(chained);
    m->stages = std::move(stages);
    m->info = std::move(info);
    m->reference.clear();
    m->calibrated = true;
    return 0;
}

int model_probe(hapi_model *m, int channels, int height, int width, hapi_error *err)
{
    c10::InferenceMode guard;
    torch::Tensor x = torch::zeros({1, channels, height, width}, torch::kFloat);
    std::vector<hapi_stage_info> info = m->info;
    for (size_t i = 0; i < m->stages.size(); i++) {
        x = stage_input(m, i, x);
        torch::jit::IValue y;
        try {
            y = m->stages[i].forward({x});
        } catch (const c10::Error &e) {
            std::string what = std::string("stage ") + info[i].name;
            return error_from_c10(e, HAPI_EMODEL, what.c_str(), err);
        } catch (const std::runtime_error &e) {
            // The TorchScript interpreter rethrows an op's error as a runtime_error.
            return stage_error(e, info[i].name, err);
        }
        if (!y.isTensor())
            return hapi_error_set(err, HAPI_EMODEL, "stage %s returned a %s, not a tensor",
                                  info[i].name, y.tagKind().c_str());
        x = y.toTensor();
        if (x.dim() < 1 || x.size(0) != 1 || x.dim() - 1 > HAPI_MAX_DIMS)
            return hapi_error_set(err, HAPI_EMODEL,
                                  "stage %s: output of %d dimensions, first %lld; expected "
                                  "the batch (1) first and at most %d more", info[i].name,
                                  (int)x.dim(), x.dim() ? (long long)x.size(0) : 0LL,
                                  HAPI_MAX_DIMS);
        if (x.scalar_type() != m->stage_precision[i])
            return hapi_error_set(err, HAPI_EMODEL, "stage %s: output is %s, not %s",
                                  info[i].name, c10::toString(x.scalar_type()),
                                  c10::toString(m->stage_precision[i]));
        info[i].ndim = (int)x.dim() - 1;
        for (int d = 0; d < info[i].ndim; d++)
            info[i].shape[d] = x.size(d + 1);
    }
    int64_t old_c = m->channels, old_h = m->height, old_w = m->width;
    m->channels = channels;
    m->height = height;
    m->width = width;
    if (!m->reference.empty() && m->precision == torch::kBFloat16) {
        int rc = model_check_bf16(m, info, err);
        if (rc < 0) {
            m->channels = old_c;
            m->height = old_h;
            m->width = old_w;
            return rc;
        }
    }
    m->info = std::move(info);
    m->probed = true;
    return 0;
}

// Runs stage i of [.., to) on x: quantized (*quantized) when the stage before passed it on,
// and passing its own output on quantized when it chains to stage i + 1 < to (hapi_model.chain).
torch::Tensor run_chained(hapi_model *m, int i, int to, const torch::Tensor &x, bool *quantized)
{
    bool in_q = *quantized, out_q = !m->chain.empty() && m->chain[i] && i + 1 < to;
    torch::jit::Module &stage = in_q || out_q ? m->chained[i][in_q | out_q << 1] : m->stages[i];
    torch::Tensor y = stage.forward({in_q ? x : stage_input(m, (size_t)i, x)}).toTensor();
    *quantized = out_q;
    return y;
}

int model_run_range(hapi_model *m, int from, int to, const void *input, int in_dtype, int batch,
                    int dtype, void *output, size_t output_size, hapi_error *err)
{
    if (!m->probed)
        return hapi_error_set(err, HAPI_EINVAL, "model run before hapi_model_probe()");
    int n = (int)m->stages.size();
    if (from < 0 || to <= from || to > n)
        return hapi_error_set(err, HAPI_EINVAL, "stages [%d, %d) out of range: 0 <= from < to <= %d",
                              from, to, n);
    if (batch < 1 || !input || !output)
        return hapi_error_set(err, HAPI_EINVAL, "bad batch (%d) or null buffer", batch);
    if ((dtype != HAPI_DTYPE_FP32 && dtype != HAPI_DTYPE_FP16) ||
        (in_dtype != HAPI_DTYPE_FP32 && in_dtype != HAPI_DTYPE_FP16))
        return hapi_error_set(err, HAPI_EINVAL, "unknown dtype %d or %d", dtype, in_dtype);
    const hapi_stage_info &last = m->info[to - 1];
    size_t elem = dtype == HAPI_DTYPE_FP16 ? 2 : 4;
    size_t need = (size_t)batch * (size_t)sample_elements(last) * elem;
    if (output_size < need)
        return hapi_error_set(err, HAPI_EINVAL, "output buffer of %zu bytes, %zu needed",
                              output_size, need);
    std::vector<int64_t> in_sizes{batch};
    if (from == 0) {
        in_sizes.insert(in_sizes.end(), {m->channels, m->height, m->width});
    } else {
        const hapi_stage_info &before = m->info[from - 1];
        in_sizes.insert(in_sizes.end(), before.shape, before.shape + before.ndim);
    }

    c10::InferenceMode guard;
    // The caller's buffer is wrapped, not copied; staged models never write to their input.
    torch::Tensor x = torch::from_blob(const_cast<void *>(input), in_sizes,
                                       in_dtype == HAPI_DTYPE_FP16 ? torch::kHalf : torch::kFloat);
    bool quantized = false;  // x is an int8 stage's output, passed on as it is (chain)
    for (int i = from; i < to; i++) {
        try {
            x = run_chained(m, i, to, x, &quantized);
        } catch (const c10::Error &e) {
            std::string what = std::string("stage ") + m->info[i].name;
            return error_from_c10(e, HAPI_EMODEL, what.c_str(), err);
        } catch (const std::runtime_error &e) {
            return stage_error(e, m->info[i].name, err);
        }
    }
    std::vector<int64_t> sizes{batch};
    sizes.insert(sizes.end(), last.shape, last.shape + last.ndim);
    if (x.sizes() != c10::IntArrayRef(sizes))
        return hapi_error_set(err, HAPI_EMODEL, "stage %s: output shape changed since the probe",
                              last.name);
    // One copy into the caller's buffer, converting to fp16 and back to the CPU on the way.
    torch::Tensor dst = torch::from_blob(output, sizes,
                                         dtype == HAPI_DTYPE_FP16 ? torch::kHalf : torch::kFloat);
    dst.copy_(x);
    return 0;
}

int model_measure(hapi_model *m, int batch, hapi_model_hook_fn hook, void *ctx,
                  uint64_t *stage_ns, hapi_error *err)
{
    if (!m->probed)
        return hapi_error_set(err, HAPI_EINVAL, "measure before hapi_model_probe()");
    if (batch < 1 || !stage_ns)
        return hapi_error_set(err, HAPI_EINVAL, "measure: bad batch (%d) or null buffer", batch);
    c10::InferenceMode guard;
    torch::Tensor x = torch::randn({batch, m->channels, m->height, m->width}, torch::kFloat);
    bool quantized = false;
    for (size_t i = 0; i < m->stages.size(); i++) {
        if (!quantized)
            x = stage_input(m, i, x);  // outside the timed part
        if (hook)
            hook(ctx, (int)i, 0);
        uint64_t t0 = hapi_now_ns();
        try {
            torch::Tensor y = run_chained(m, (int)i, (int)m->stages.size(), x, &quantized);
            if (!m->device.is_cpu())
                y = y.cpu();  // waits for the device, so the time is the stage's
            x = y;
        } catch (const c10::Error &e) {
            std::string what = std::string("stage ") + m->info[i].name;
            return error_from_c10(e, HAPI_EMODEL, what.c_str(), err);
        } catch (const std::runtime_error &e) {
            return stage_error(e, m->info[i].name, err);
        }
        stage_ns[i] = hapi_now_ns() - t0;
        if (hook)
            hook(ctx, (int)i, 1);
        if (!m->device.is_cpu())
            x = x.to(m->device);
    }
    return 0;
}

}  // namespace

// Wraps an entry point: every exception becomes a code and a one-line message.
#define HAPI_MODEL_CATCH(context)                                                                  \
    catch (const c10::Error &e) {                                                                  \
        return error_from_c10(e, HAPI_EMODEL, context, err);                                       \
    }                                                                                              \
    catch (const std::bad_alloc &) {                                                               \
        return hapi_error_set(err, HAPI_EOOM, "%s: out of memory", context);                       \
    }                                                                                              \
    catch (const std::exception &e) {                                                              \
        return hapi_error_set(err, HAPI_EMODEL, "%s: %s", context, one_line(e.what()).c_str());    \
    }                                                                                              \
    catch (...) {                                                                                  \
        return hapi_error_set(err, HAPI_EMODEL, "%s: unknown C++ exception", context);             \
    }

extern "C" {

int hapi_model_load(const char *path, const hapi_model_options *opt, hapi_model **out,
                    hapi_error *err) noexcept
{
    if (!out)
        return hapi_error_set(err, HAPI_EINVAL, "hapi_model_load: null out pointer");
    *out = nullptr;
    if (!path || !*path)
        return hapi_error_set(err, HAPI_EINVAL, "hapi_model_load: empty path");
    try {
        return model_load(path, opt, out, err);
    }
    HAPI_MODEL_CATCH(path)
}

void hapi_model_free(hapi_model *m) noexcept
{
    try {
        delete m;
    } catch (...) {
        // Destructors of TorchScript modules do not throw; nothing to report to anyway.
    }
}

const char *hapi_model_metadata(const hapi_model *m) noexcept
{
    return m ? m->metadata.c_str() : nullptr;
}

int hapi_model_num_stages(const hapi_model *m) noexcept
{
    return m ? (int)m->stages.size() : 0;
}

int hapi_model_probe(hapi_model *m, int channels, int height, int width, hapi_error *err) noexcept
{
    if (!m || channels < 1 || height < 1 || width < 1)
        return hapi_error_set(err, HAPI_EINVAL, "probe: bad input shape %dx%dx%d", channels, height,
                              width);
    try {
        return model_probe(m, channels, height, width, err);
    }
    HAPI_MODEL_CATCH("probe")
}

int hapi_model_calibrate(hapi_model *m, const float *samples, int n, double min_cosine, int at,
                         hapi_error *err) noexcept
{
    if (!m || !m->int8 || !m->probed || m->calibrated || !samples || n < 1 ||
        !(min_cosine >= 0 && min_cosine <= 1) || at >= (int)m->stages.size())
        return hapi_error_set(err, HAPI_EINVAL, "calibrate: %s",
                              !m || !m->int8 ? "not an int8 model"
                              : !m->probed   ? "before hapi_model_probe()"
                              : m->calibrated ? "calibrated already"
                              : n < 1 || !samples ? "no samples"
                              : at >= (int)m->stages.size() ? "no such stage"
                                                            : "a bound outside 0..1");
    try {
        c10::InferenceMode off(false);  // the quantized weights are ordinary tensors
        torch::Tensor x = torch::from_blob(const_cast<float *>(samples),
                                           {n, m->channels, m->height, m->width}, torch::kFloat)
                              .clone();
        return model_calibrate_int8(m, x, min_cosine, at, err);
    }
    HAPI_MODEL_CATCH("calibrate")
}

int hapi_model_stage(const hapi_model *m, int index, hapi_stage_info *info) noexcept
{
    if (!m || !info || index < 0 || index >= (int)m->info.size())
        return HAPI_EINVAL;
    *info = m->info[index];
    return 0;
}

int hapi_model_run(hapi_model *m, int split, const float *input, int batch, int dtype,
                   void *output, size_t output_size, hapi_error *err) noexcept
{
    if (m && (split < 1 || split > (int)m->stages.size()))
        return hapi_error_set(err, HAPI_EINVAL, "split %d out of range 1..%d", split,
                              (int)m->stages.size());
    return hapi_model_run_range(m, 0, split, input, HAPI_DTYPE_FP32, batch, dtype, output,
                                output_size, err);
}

int hapi_model_run_range(hapi_model *m, int from, int to, const void *input, int in_dtype,
                         int batch, int dtype, void *output, size_t output_size,
                         hapi_error *err) noexcept
{
    if (!m)
        return hapi_error_set(err, HAPI_EINVAL, "run: null model");
    try {
        return model_run_range(m, from, to, input, in_dtype, batch, dtype, output, output_size,
                               err);
    }
    HAPI_MODEL_CATCH("run")
}

int hapi_model_measure(hapi_model *m, int batch, hapi_model_hook_fn hook, void *ctx,
                       uint64_t *stage_ns, hapi_error *err) noexcept
{
    if (!m)
        return hapi_error_set(err, HAPI_EINVAL, "measure: null model");
    try {
        return model_measure(m, batch, hook, ctx, stage_ns, err);
    }
    HAPI_MODEL_CATCH("measure")
}

}  // extern "C"
