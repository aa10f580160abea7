/* The CPU RMSNorm with a gradient, as one C++ autograd node.
 *
 * A torch.autograd.Function costs a Python node, context and frame on every
 * call, more than LayerNorm's whole call at small shapes. This extension makes
 * the node C++'s: one METH_FASTCALL function applies a
 * torch::autograd::Function whose forward is what the call computes without a
 * gradient (the fused kernel of rmsnorm_cpu.c where cpu.supports would pick
 * it, else the reference math, op for op) and whose backward is the op's
 * backward (enjoyln/ops/__init__.py), op for op.
 * Built by enjoyln/ops/grad.py against the running torch's headers.
 */
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/rsqrt.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <vector>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/* rmsnorm_cpu.c's kernels, by dtype, as the C library the process loaded
 * (set_kernels): the same code, so the same bits as a call without a gradient */
typedef void (*kernel_fn)(const void*, const void*, const void*, void*, int64_t, int64_t, float, int);
static kernel_fn kernels[3];

static kernel_fn kernel_for(const at::Tensor& x) {
    switch (x.scalar_type()) {
        case at::kFloat: return kernels[0];
        case at::kBFloat16: return kernels[1];
        case at::kHalf: return kernels[2];
        default: return nullptr;
    }
}

static bool fits(const at::Tensor& t, const at::Tensor& x) { /* cpu.supports, for a gain or bias */
    return !t.defined() || (t.scalar_type() == x.scalar_type() && t.is_cpu() && t.is_contiguous());
}

static std::vector<int64_t> trailing(int64_t k) {
    std::vector<int64_t> dims;
    for (int64_t i = -k; i < 0; i++) dims.push_back(i);
    return dims;
}

/* rms_norm_reference, op for op */
static at::Tensor reference(const at::Tensor& x, int64_t k, const at::Tensor& w, const at::Tensor& b, double eps) {
    at::Tensor xf = x.to(at::promote_types(x.scalar_type(), at::kFloat));
    at::Tensor y = xf * at::rsqrt(xf.square().mean(trailing(k), true) + eps);
    if (w.defined()) y = y * w.to(xf.scalar_type());
    if (b.defined()) y = y + b.to(xf.scalar_type());
    return y.to(x.scalar_type());
}

struct EnjoylnRMSNorm : public torch::autograd::Function<EnjoylnRMSNorm> {
    /* a gain or bias as std::optional: an undefined at::Tensor argument would be taken for an input */
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const std::optional<at::Tensor>& gain,
                              const std::optional<at::Tensor>& shift, int64_t n, int64_t k, double eps) {
        const at::Tensor x = input.contiguous();  /* as ops._forward */
        const at::Tensor w = gain.value_or(at::Tensor()), b = shift.value_or(at::Tensor());
        ctx->save_for_backward({x, w});
        ctx->saved_data["k"] = k;
        ctx->saved_data["eps"] = eps;
        if (b.defined()) ctx->saved_data["bias"] = b.scalar_type();
        kernel_fn kernel = kernel_for(x);
        if (!kernel || x.numel() == 0 || n <= 0 || !fits(w, x) || !fits(b, x)) return reference(x, k, w, b, eps);
        at::Tensor y = at::empty_like(x);
        kernel(x.data_ptr(), w.defined() ? w.data_ptr() : nullptr, b.defined() ? b.data_ptr() : nullptr,
               y.data_ptr(), x.numel() / n, n, (float)eps, at::get_num_threads());
        return y;
    }

    /* d/dx of x·r·w + b with r = (mean(x²) + eps)^-½, in float32 (or wider): ops._backward, op for op */
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const variable_list saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &w = saved[1];
        const int64_t k = ctx->saved_data["k"].toInt();
        const std::vector<int64_t> dims = trailing(k);
        std::vector<int64_t> lead;
        for (int64_t i = 0; i < x.dim() - k; i++) lead.push_back(i);
        const auto wide = at::promote_types(x.scalar_type(), at::kFloat);
        const at::Tensor xf = x.to(wide), g = grads[0].to(wide);
        const at::Tensor r = at::rsqrt(xf.square().mean(dims, true) + ctx->saved_data["eps"].toDouble());
        at::Tensor dx, dw, db;
        if (ctx->needs_input_grad(0)) {
            const at::Tensor gw = w.defined() ? g * w.to(wide) : g;
            dx = (r * (gw - xf * r.square() * (xf * gw).mean(dims, true))).to(x.scalar_type());
        }
        if (w.defined() && ctx->needs_input_grad(1)) dw = (g * xf * r).sum(lead).to(w.scalar_type());
        if (ctx->saved_data.find("bias") != ctx->saved_data.end() && ctx->needs_input_grad(2))
            db = g.sum(lead).to(ctx->saved_data["bias"].toScalarType());
        return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

static std::optional<at::Tensor> optional_tensor(PyObject* obj) {
    if (obj == Py_None) return std::nullopt;
    if (!THPVariable_Check(obj)) throw torch::TypeError("expected a tensor or None");
    return THPVariable_Unpack(obj);
}

/* rms_norm(x, normalized_shape, weight, bias, eps) -> Tensor */
static PyObject* rms_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 5 || !THPVariable_Check(args[0]))
        throw torch::TypeError("rms_norm(x, normalized_shape, weight, bias, eps)");
    PyObject* shape = PySequence_Fast(args[1], "normalized_shape must be a sequence of ints");
    if (!shape) return nullptr;
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(shape);
    int64_t n = 1;
    for (Py_ssize_t i = 0; i < k; i++) n *= PyLong_AsLongLong(PySequence_Fast_GET_ITEM(shape, i));
    Py_DECREF(shape);
    const double eps = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return nullptr;
    return THPVariable_Wrap(EnjoylnRMSNorm::apply(THPVariable_Unpack(args[0]), optional_tensor(args[2]),
                                                  optional_tensor(args[3]), n, (int64_t)k, eps));
    END_HANDLE_TH_ERRORS
}

/* set_kernels(f32, bf16, f16): the kernels' addresses, 0 where there is none */
static PyObject* set_kernels(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "set_kernels(f32, bf16, f16)");
        return nullptr;
    }
    for (int i = 0; i < 3; i++) {
        kernels[i] = (kernel_fn)PyLong_AsVoidPtr(args[i]);
        if (PyErr_Occurred()) return nullptr;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))rms_norm, METH_FASTCALL, "RMSNorm as one C++ autograd node"},
    {"set_kernels", (PyCFunction)(void (*)(void))set_kernels, METH_FASTCALL, "the fused kernels' addresses"},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "rmsnorm_grad", nullptr, -1, methods};

PyMODINIT_FUNC PyInit_rmsnorm_grad(void) { return PyModule_Create(&module); }
