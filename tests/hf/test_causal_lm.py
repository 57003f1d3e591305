"""A causal language model (a tiny random GPT-2 with LoRA on its fused attention projection)
under the token-level likelihood: the next-token log-likelihood of Hugging Face's loss with
either padding side, and the vectorized paths over an output that carries a key/value cache."""

import warnings

import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.optim import Adam
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import pyro_bdl as bdl  # noqa: E402

VOCAB, ROWS, LENGTH, N = 30, 3, 7, 20


def _gpt2():
    config = transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=16,
        attn_implementation="eager",
    )  # fmt: skip
    net = transformers.GPT2LMHeadModel(config).eval()
    lora = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's, not ours
        net = peft.get_peft_model(net, lora).eval()
    for name, p in net.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)  # PEFT starts B at zero
    return net


def _batch(left):
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH))
    mask = torch.ones_like(ids)
    if left:
        mask[0, :3] = 0
    else:
        mask[0, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _log_likelihood(model, net, batch, y):
    data = {name: spec.init_value for name, spec in bdl.sites(net).items()}
    trace = poutine.trace(poutine.condition(model, data=data)).get_trace(batch, y)
    trace.compute_log_prob()
    return trace.nodes["y"]["unscaled_log_prob"]


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_next_token_likelihood_is_the_hf_loss_with_either_padding_side(left):
    net = _gpt2()
    batch = _batch(left)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    expected = net(**batch, labels=labels).loss  # the mean over the scored next tokens
    scored = int((labels[:, 1:] != -100).sum())
    model = bdl.models.language_model(bdl.bayesianize(net, expose=bdl.nn.lora), N)
    # The mask drops the padding whether the labels are the ids or carry -100 there.
    for y in (batch["input_ids"], labels):
        assert_close(-_log_likelihood(model, net, batch, y).sum() / scored, expected)
    ignored = labels.clone()
    ignored[1] = -100
    per_row = _log_likelihood(model, net, batch, ignored)
    assert per_row[1] == 0 and bool((per_row[[0, 2]] < 0).all())


def test_vectorized_particles_and_parallel_prediction_drop_the_key_value_cache():
    net = _gpt2()
    assert net.config.use_cache  # the output carries a cache built per weight sample
    model = bdl.models.language_model(bdl.bayesianize(net, expose=bdl.nn.lora), N)
    batch = _batch(left=False)
    guide = bdl.guides.AutoMeanField(model)
    elbo = Trace_ELBO(num_particles=2, vectorize_particles=True)
    loss = SVI(model, guide, Adam({"lr": 1e-2}), elbo).step(batch, batch["input_ids"])
    assert torch.isfinite(torch.tensor(loss))
    names = list(bdl.sites(net))
    draws = Predictive(
        model, guide=guide, num_samples=3, parallel=True, return_sites=["_RETURN", *names]
    )(batch)
    assert draws["_RETURN"].shape == (3, ROWS, LENGTH, VOCAB)
    # Each sample's logits are the plain forward's at that sample's weights.
    data = {name: draws[name][1].reshape(bdl.sites(net)[name].shape) for name in names}
    assert_close(draws["_RETURN"][1], poutine.condition(net, data=data)(**batch).logits)


def test_a_bfloat16_base_under_float32_adapters_scores_tokens_in_float32():
    torch.manual_seed(0)
    vocab, length = 500, 64
    config = transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=vocab, n_positions=length,
        attn_implementation="eager",
    )  # fmt: skip
    net = transformers.GPT2LMHeadModel(config).eval().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's, not ours
        lora = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
        net = peft.get_peft_model(net, lora).eval()
    assert {p.dtype for n, p in net.named_parameters() if "lora_" in n} == {torch.float32}
    ids = torch.randint(0, vocab, (2, length))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    logits = net(**batch).logits
    assert logits.dtype == torch.bfloat16
    # Hugging Face's causal-LM loss upcasts the logits; its sum over the 63 scored tokens.
    expected = torch.log_softmax(logits[:, :-1].float(), -1)
    expected = expected.gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)
    model = bdl.models.language_model(bdl.bayesianize(net, expose=bdl.nn.lora), N)
    got = _log_likelihood(model, net, batch, ids)
    # In bfloat16 each sum of about -400 nats would round to a multiple of 2; in float32 the
    # sums agree to float32 rounding of 63 terms (relative 1e-6).
    assert got.dtype == torch.float32
    assert_close(got, expected, rtol=1e-6, atol=0)
