// The autograd of fusedattn::forward, in C++: an attention call that needs
// gradients then costs the host a few microseconds more than one that does not
// (torch.library.register_autograd's Python wrapper cost about 35 us a call).
// The backward runs fusedattn::backward with the saved out and lse; it is not
// differentiable itself, so a backward that would build a graph raises.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fusedattn::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool,
    std::optional<double>, std::optional<c10::string_view>, at::OptionalIntArrayRef, std::optional<double>,
    const std::optional<at::Tensor>&);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&, bool, std::optional<double>,
    std::optional<c10::string_view>, at::OptionalIntArrayRef, std::optional<double>,
    const std::optional<at::Tensor>&);

std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor> forward_below_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, std::optional<double> scale, std::optional<c10::string_view> family,
    at::OptionalIntArrayRef window, std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fusedattn::forward", "").typed<ForwardSignature>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(q, k, v, attn_mask, is_causal, scale, family, window, softcap, sinks);
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& attn_mask, bool is_causal,
                               std::optional<double> scale, std::optional<c10::string_view> family,
                               at::OptionalIntArrayRef window, std::optional<double> softcap,
                               const std::optional<at::Tensor>& sinks) {
    TORCH_CHECK(!(attn_mask && attn_mask->requires_grad()),
                "fusedattn: gradients with respect to attn_mask are not supported; pass attn_mask.detach()");
    auto [out, lse] = forward_below_autograd(q, k, v, attn_mask, is_causal, scale, family, window, softcap, sinks);
    ctx->set_materialize_grads(false);  // grad_out stays undefined where only lse was used
    ctx->save_for_backward({q, k, v, out, lse, attn_mask.value_or(at::Tensor()), sinks.value_or(at::Tensor())});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["family"] = family ? c10::IValue(std::string(*family)) : c10::IValue();
    ctx->saved_data["window"] = window ? c10::IValue(window->vec()) : c10::IValue();
    ctx->saved_data["softcap"] = softcap;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "fusedattn: the attention backward is not differentiable (a double backward, create_graph=True, "
                "is not supported)");
    const at::Tensor& grad_out = grads[0];
    variable_list none(10);  // one gradient a forward argument
    if (!grad_out.defined()) return none;  // only lse was used downstream, and lse has no gradient
    const auto saved = ctx->get_saved_variables();
    const std::optional<at::Tensor> attn_mask = defined_or_none(saved[5]), sinks = defined_or_none(saved[6]);
    const auto& data = ctx->saved_data;
    const std::optional<std::string> family =
        data.at("family").isNone() ? std::nullopt : std::optional<std::string>(data.at("family").toStringRef());
    const std::optional<std::vector<int64_t>> window =
        data.at("window").isNone() ? std::nullopt : std::optional<std::vector<int64_t>>(data.at("window").toIntVector());
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("fusedattn::backward", "").typed<BackwardSignature>();
    auto [grad_q, grad_k, grad_v, grad_sinks] =
        op.call(grad_out.contiguous(), saved[0], saved[1], saved[2], saved[3], saved[4], attn_mask,
                data.at("is_causal").toBool(), data.at("scale").toOptional<double>(),
                family ? std::optional<c10::string_view>(*family) : std::nullopt,
                window ? at::OptionalIntArrayRef(*window) : at::OptionalIntArrayRef(),
                data.at("softcap").toOptional<double>(), sinks);
    none[0] = grad_q;
    none[1] = grad_k;
    none[2] = grad_v;
    if (sinks) none[9] = grad_sinks;
    return none;
  }
};

std::tuple<at::Tensor, at::Tensor> forward_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const std::optional<at::Tensor>& attn_mask, bool is_causal,
                                                    std::optional<double> scale,
                                                    std::optional<c10::string_view> family,
                                                    at::OptionalIntArrayRef window, std::optional<double> softcap,
                                                    const std::optional<at::Tensor>& sinks) {
  const bool graph = at::GradMode::is_enabled() &&
                     (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                      (attn_mask && attn_mask->requires_grad()) || (sinks && sinks->requires_grad()));
  if (!graph)  // no gradient to record: a mask that requires one is fine here
    return forward_below_autograd(q, k, v, attn_mask, is_causal, scale, family, window, softcap, sinks);
  const variable_list result =
      AttentionFunction::apply(q, k, v, attn_mask, is_causal, scale, family, window, softcap, sinks);
  return {result[0], result[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedattn, Autograd, m) { m.impl("forward", TORCH_FN(forward_autograd)); }

}  // namespace fusedattn::ops
