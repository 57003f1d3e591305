"""``fit(trim_padding=True)``: right-padded text batches regrouped by length and trimmed give the
posterior of the batches as given (a tiny random BERT with LoRA adapters, ragged masks), and
masks it cannot trim exactly are refused."""

import pyro
import pytest
import torch
from torch.testing import assert_close

from tests.hf import lora_bert, tiny_bert_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import pyro_bdl as bdl  # noqa: E402
from pyro_bdl.guides.laplace.model import leaf_slots, sites_touched  # noqa: E402
from pyro_bdl.guides.laplace.padding import ByLength, plan_groups, row_lengths  # noqa: E402

VOCAB, LENGTH, ROWS = 50, 12, 24

#: float32 forward passes of the trimmed and the padded batches differ only in the order and
#: width of their sums (attention over 12 or fewer keys, matrix products blocked by width), each
#: within a few ε = 1.2e-7 of its value; a curvature entry is a product of two such derivatives
#: summed over rows, so its relative error is ~10 ε ≈ 1e-6 typically, and the posterior
#: (GGN + λ)⁻¹ with λ = 1 adds no more than its condition number ~10 here: 1e-5 relative with an
#: absolute floor at 1e-5 of the largest entry (entries that cancel to ~0). Observed: at most
#: 4e-8 relative (the diagonal), 2e-9 for the last layer's GGN.
RTOL = 1e-5


def _model():
    torch.manual_seed(0)
    net = lora_bert(tiny_bert_config(VOCAB, 2, num_hidden_layers=2), rank=4)
    bdl.bayesianize(net, expose=bdl.nn.lora_and_head)
    return bdl.models.classifier(net, ROWS)


def _batches(seed=0):
    """Two right-padded batches of 12 rows, lengths 2 to 12 in random order (the padding holds
    random ids, which the mask hides), with token types."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        lengths = (torch.randperm(LENGTH, generator=g) + 1).clamp_min(2)
        mask = (torch.arange(LENGTH) < lengths[:, None]).long()
        ids = torch.randint(1, VOCAB, (LENGTH, LENGTH), generator=g)
        types = torch.randint(0, 2, (LENGTH, LENGTH), generator=g)
        x = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        out.append((x, torch.randint(0, 2, (LENGTH,), generator=g)))
    return out


def _fit(subnetwork, structure, trim):
    pyro.clear_param_store()
    model = _model()
    data = _batches()
    guide = bdl.guides.AutoSubnetLaplace(
        model, subnetwork=subnetwork, hessian_structure=structure, batch_size=8
    )
    guide(*data[0])
    return guide.fit(data, check_mode=False, trim_padding=trim)


def _close(a, b):
    assert_close(a, b, rtol=RTOL, atol=RTOL * float(b.abs().max()))


@pytest.mark.parametrize(
    "subnetwork, structure", [("last_layer", "full"), ("all", "kron"), ("all", "diag")]
)
def test_trimmed_fit_is_the_padded_fit(subnetwork, structure):
    padded, trimmed = _fit(subnetwork, structure, False), _fit(subnetwork, structure, True)
    assert torch.equal(padded.subnet_index, trimmed.subnet_index)
    _close(trimmed._stats, padded._stats)  # rows, and the loss sums over them
    assert float(trimmed._stats[0]) == 2 * LENGTH
    if structure == "full":
        _close(trimmed.ggn, padded.ggn)
        _close(trimmed.covariance, padded.covariance)
    elif structure == "kron":
        for (a1, g1), (a0, g0) in zip(trimmed.posterior.factors(), padded.posterior.factors()):
            _close(a1, a0)
            _close(g1, g0)
    else:
        _close(trimmed.posterior.precision, padded.posterior.precision)
    _close(trimmed.posterior.variances(), padded.posterior.variances())
    assert float(padded.posterior.variances().std()) > 0  # not a prior-only posterior


def test_groups_are_sorted_trimmed_and_cover_every_row_once():
    data = _batches()
    groups = list(ByLength(data, max_rows=5))
    assert sum(len(y) for _, y in groups) == 2 * LENGTH
    for x, _ in groups:
        assert len(x["input_ids"]) <= 5
        mask = x["attention_mask"]
        assert x["input_ids"].shape == mask.shape == x["token_type_ids"].shape
        assert bool(mask[:, -1].any())  # trimmed to the group's longest row
    seen = sorted(tuple(x["input_ids"][i, : int(x["attention_mask"][i].sum())].tolist())
                  for x, _ in groups for i in range(len(x["input_ids"])))  # fmt: skip
    given = sorted(tuple(x["input_ids"][i, : int(x["attention_mask"][i].sum())].tolist())
                   for x, _ in data for i in range(LENGTH))  # fmt: skip
    assert seen == given


def test_plan_groups_weighs_positions_against_calls():
    lengths = [1, 1, 1, 10]
    assert plan_groups(lengths, 4, call_tokens=0) == [3, 4]  # 3 + 10 positions, not 40
    assert plan_groups(lengths, 4, call_tokens=100) == [4]  # one call beats saving 27
    ends = plan_groups([5] * 7, 3, call_tokens=1)  # equal lengths: the fewest groups of ≤ 3
    assert ends[-1] == 7 and len(ends) == 3
    assert all(0 < b - a <= 3 for a, b in zip([0, *ends], ends))


@pytest.mark.parametrize(
    "mask, message",
    [
        ([[1, 1, 0], [1, 2, 0]], "zeros and ones"),
        ([[1, 1, 0], [0, 1, 1]], "right padding"),
        ([[1, 0, 1], [1, 1, 1]], "right padding"),
        ([[1, 1, 0], [0, 0, 0]], "at least one one"),
    ],
)
def test_masks_it_cannot_trim_exactly_are_refused(mask, message):
    with pytest.raises(ValueError, match=message):
        row_lengths(torch.tensor(mask))


def test_kron_refuses_one_token_rows():
    # A one-token row's query has no gradient; KFAC's reduce form then averages its input over
    # the batch's width, which trimming changes.
    data = _batches()
    mask = data[0][0]["attention_mask"].clone()
    mask[3] = 0
    mask[3, 0] = 1
    data[0] = (dict(data[0][0], attention_mask=mask), data[0][1])
    assert sum(len(y) for _, y in ByLength(data, 8)) == 2 * LENGTH  # fine for full and diag
    with pytest.raises(ValueError, match=r"row 3 .* has 1"):
        list(ByLength(data, 8, min_length=2))


def test_refusals_leave_the_guide_unfitted():
    pyro.clear_param_store()
    model = _model()
    data = _batches()
    guide = bdl.guides.AutoSubnetLaplace(model, subnetwork="last_layer", hessian_structure="full")
    guide(*data[0])
    left = dict(data[0][0], attention_mask=data[0][0]["attention_mask"].flip(1))
    with pytest.raises(ValueError, match="right padding"):
        guide.fit([(left, data[0][1])], check_mode=False, trim_padding=True)
    with pytest.raises(TypeError, match="trim_padding"):
        guide.fit(data, trim_padding="yes")
    assert not guide.fitted
    packed = torch.stack([data[0][0]["input_ids"], data[0][0]["attention_mask"]], 1)
    with pytest.raises(TypeError, match="attention_mask"):  # a tensor x: no mask to read
        list(ByLength((packed, data[0][1]), 8))


def test_only_the_subnetwork_sites_require_grad():
    pyro.clear_param_store()
    guide = _fit("last_layer", "full", False)
    wanted = sites_touched(guide.layout, guide.subnet_index)
    _, slots = leaf_slots(guide.layout, guide.map_loc, wanted)
    flags = {site.name: slot.value.requires_grad for site, slot in zip(guide.layout, slots)}
    assert sum(flags.values()) == 2 and all(
        flag == ("modules_to_save" in name) for name, flag in flags.items()
    ), flags
    _, every = leaf_slots(guide.layout, guide.map_loc)
    assert all(slot.value.requires_grad for slot in every)


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_a_refused_first_batch_leaves_a_fresh_guide_unset(structure):
    # fit on a guide never called sets it up from the first batch; a mask that trim_padding
    # refuses there is refused before that set-up, so nothing was created.
    pyro.clear_param_store()
    model = _model()
    data = _batches()
    x, y = data[0]
    if structure == "full":
        x = dict(x, attention_mask=x["attention_mask"].flip(1))  # left padding
    else:
        mask = x["attention_mask"].clone()
        mask[0, 1:] = 0  # a one-token row
        x = dict(x, attention_mask=mask)
    guide = bdl.guides.AutoSubnetLaplace(
        model, subnetwork="last_layer", hessian_structure=structure
    )
    with pytest.raises(ValueError, match="trim_padding"):
        guide.fit([(x, y)], check_mode=False, trim_padding=True)
    assert guide.prototype_trace is None and not list(pyro.get_param_store().keys())
    with pytest.raises(TypeError, match="attention_mask"):
        guide.fit((x["input_ids"], y), check_mode=False, trim_padding=True)
    assert guide.prototype_trace is None and not list(pyro.get_param_store().keys())
