"""The model object behind every factory of :mod:`pyro_bdl.models`: :class:`NetworkModel`, its
data plate and its likelihoods."""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable, Mapping

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from torch import nn
from torch.distributions import Distribution as TorchDistribution

from pyro_bdl._validation import check_choice, check_positive, check_positive_int
from pyro_bdl.models.checks import (
    IGNORE_INDEX,
    NetworkShape,
    batch_tensors,
    check_batch,
    check_token_range,
    label_range,
    rollback,
)
from pyro_bdl.models.noise import (
    NOISES,
    SIGMA,
    NoiseSite,
    check_likelihood_range,
    check_noise_prior,
    default_noise_prior,
    param_name,
)
from pyro_bdl.models.structured import Batch, Output, call_network, check_output, select_output
from pyro_bdl.nn.vectorize import under_plate

__all__ = ["DATA_PLATE", "LIKELIHOOD", "NetworkModel", "data_plate", "mean_log_variance"]

#: The name of the plate over examples; VOGN and the diagnostics look for it.
DATA_PLATE = "data"

#: Set in the ``infer`` dict of a ready-made model's likelihood site: guides leave that site out
#: of their prototype even when it is not observed (``y=None``: ``Predictive(model, guide)(x)``
#: as the guide's first call), as Pyro's autoguides leave out an observed one.
LIKELIHOOD = "pyro_bdl_likelihood"

# The names of the models alive in this process (a name is the prefix of the params a model
# creates in Pyro's global param store, so two live models must never share one), and the
# counter of default names, never reused within a process so a stale param cannot be picked up.
_LIVE: weakref.WeakValueDictionary[str, NetworkModel] = weakref.WeakValueDictionary()
_DEFAULT_NAMES = itertools.count()


def _claim_name(name: str | None, model: NetworkModel) -> str:
    if name is None:
        name = next(n for n in (f"model_{k}" for k in _DEFAULT_NAMES) if n not in _LIVE)
    elif not isinstance(name, str):
        raise TypeError(
            f"name must be a non-empty str without '.', the prefix of the params the model "
            f"creates; got {type(name).__name__} {name!r}. Pass e.g. name='regressor'."
        )
    elif not name or "." in name:
        raise ValueError(
            f"name must be a non-empty str without '.', the prefix of the params the model "
            f"creates; got {name!r}. Pass e.g. name='regressor'."
        )
    elif name in _LIVE:
        raise ValueError(
            f"name {name!r} is taken by another live model ({_LIVE[name]!r}); two models with "
            "one name would share their params in Pyro's param store. Pass another name, or "
            "leave name out for a unique one."
        )
    _LIVE[name] = model
    return name


class _LogSoftmaxCategorical(dist.Categorical):
    """``Categorical(logits=logits)``, normalised by one fused ``log_softmax`` (instead of
    ``logits - logsumexp(logits)``) and scoring labels of the batch shape with one ``gather``.

    The classifiers' likelihood pays this on every step; in every other respect (``logits``,
    ``probs``, ``sample``, ``expand``, validation) it is the ordinary ``Categorical``, except
    that the labels ``checked`` (the tensor the model's batch check already found in
    ``[0, C)``) are scored without validating them again, a device→host synchronisation on
    every step.
    """

    def __init__(
        self, logits: torch.Tensor, validate_args=None, checked: torch.Tensor | None = None
    ):
        if logits.dim() < 1:
            raise ValueError(
                "`logits` parameter must be at least one-dimensional; got a 0-d tensor. Give "
                "the network one logit per class."
            )
        self.logits = torch.log_softmax(logits, dim=-1)
        self._param = self.logits
        self._num_events = logits.shape[-1]
        self._checked = checked
        # No logits (a one-token sequence under next-token prediction): nothing to validate,
        # and torch's check cannot reshape an empty tensor.
        validate_args = validate_args if logits.numel() else False
        TorchDistribution.__init__(self, logits.shape[:-1], validate_args=validate_args)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args and value is not self._checked:
            self._validate_sample(value)
        if value.shape != self.batch_shape:  # broadcasting (e.g. enumerated values)
            return super().log_prob(value)
        return self.logits.gather(-1, value.long().unsqueeze(-1)).squeeze(-1)

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:  # what the data plate asks for on every call
            return self
        return dist.Categorical(logits=self.logits).expand(batch_shape)


def data_plate(dataset_size: int, batch_size: int, device=None) -> pyro.plate:
    """The plate over examples: scales the likelihood by N/B (``batch_size`` may exceed N when
    predicting on a larger test set, in which case no scaling applies)."""
    if batch_size > dataset_size:
        return pyro.plate(DATA_PLATE, batch_size)
    # The batch is already sliced, so the plate only needs the size for its N/B scale: explicit
    # indices avoid the randperm(N) that subsample_size would draw on every call.
    # Passing the device also spares the plate a probe tensor for the default device.
    return pyro.plate(
        DATA_PLATE,
        dataset_size,
        subsample=torch.arange(batch_size, device=device),
        device=device,
    )


class NetworkModel:
    """A Pyro model around one network, with the facts methods read from it declared.

    Calling it runs ``model(x, y=None) -> network output``: the checks of
    :mod:`~pyro_bdl.models.checks`, the network's forward pass and one observation site ``"y"``
    inside :func:`data_plate` (plus the site ``"sigma"`` of a learned noise). ``x`` may be a
    tensor, a mapping of tensors passed as keyword arguments or a tuple of tensors passed as
    positional arguments, and the network may return a ``ModelOutput``, a dict or a tuple, of
    which the likelihood reads the tensor that ``output`` selects
    (:mod:`~pyro_bdl.models.structured`); the model returns that tensor. Laplace (its GGN
    and predictive), VOGN, data-parallel training and checkpoints read :attr:`net`,
    :attr:`likelihood`, :attr:`dataset_size`, :attr:`noise` and :attr:`noise_scale` from here;
    a hand-written model has none of them, and those methods then ask for what they need.

    :ivar net: the (lifted) network.
    :ivar str likelihood: ``"categorical"``, ``"bernoulli"``, ``"gaussian"`` or ``"tokens"``
        (a categorical per token of a sequence, :meth:`_tokens`).
    :ivar int dataset_size: N, for the data plate's N/B scaling.
    :ivar str noise: the Gaussian noise model (``None`` otherwise): ``"fixed"``, ``"learned"``
        (a latent site ``"sigma"``), ``"point"`` (a ``pyro.param("sigma")``) or
        ``"heteroscedastic"`` (σ(x) from the network); see :mod:`~pyro_bdl.models.noise`.
    :ivar noise_prior: the prior over σ of a ``"learned"`` noise (``None`` otherwise).
    :ivar bool multilabel: Bernoulli over K independent logits per example (labels ``(B, K)``)
        rather than one (labels ``(B,)``).
    :ivar split: ``out -> (mean, log-variance)`` of a heteroscedastic regressor.
    :ivar NetworkShape shape: the input dtype/width and output width read from the layers.
    :ivar output: which tensor of the network's output the likelihood reads (``None``: the
        tensor itself, ``.logits``/``"logits"`` or the first element of a tuple).
    :ivar bool shift: for ``"tokens"``, score the logits at position t against the label at t+1
        (next-token prediction, labels = the input ids) rather than at t (masked tokens).
    :ivar bool check_inputs: check the batch's device against the network's, and x's dtype and
        width against the first layer (default); set it to ``False`` for a network that moves or
        converts its inputs itself.
    :ivar str name: the prefix of the params the model creates (:attr:`param_names`), unique
        among the live models: ``name=`` if given, else ``"model_<k>"`` with k counting the
        models built in this process. A checkpoint stores the params by these names, so a run
        resumed in another program builds its models in the same order, or passes ``name=``.
        A copy made while the model lives (``copy.deepcopy``, ``pickle``) gets a fresh name and
        its own copy of a point σ (:meth:`__setstate__`).
    """

    LIKELIHOODS = ("categorical", "bernoulli", "gaussian", "tokens")

    def __init__(
        self,
        net: nn.Module,
        *,
        likelihood: str,
        dataset_size: int,
        noise_scale: float | None = None,
        noise: str | None = None,
        noise_prior: TorchDistribution | None = None,
        multilabel: bool = False,
        split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
        output: Output = None,
        shift: bool = True,
        name: str | None = None,
    ):
        if not isinstance(net, nn.Module):
            raise TypeError(
                f"net must be a torch.nn.Module; got {type(net).__name__}. Pass the network, "
                "lifted with pyro_bdl.bayesianize(net)."
            )
        if likelihood not in self.LIKELIHOODS:
            raise ValueError(f"likelihood must be one of {self.LIKELIHOODS}; got {likelihood!r}.")
        check_positive_int("dataset_size", dataset_size)
        gaussian = likelihood == "gaussian"
        noise = check_choice("noise", noise or "fixed", NOISES) if gaussian else noise
        if not gaussian and (noise, noise_scale, noise_prior, split) != (None,) * 4:
            raise ValueError(
                f"noise, noise_scale, noise_prior and split belong to a Gaussian likelihood; "
                f"got them for likelihood {likelihood!r}. Drop them."
            )
        if multilabel and likelihood != "bernoulli":
            raise ValueError(
                f"multilabel=True needs likelihood='bernoulli'; got likelihood={likelihood!r}. "
                "Use models.multilabel_classifier, or drop multilabel."
            )
        if noise == "fixed" and noise_scale is None:
            raise ValueError(
                "a Gaussian likelihood needs noise_scale, the observation noise σ (or "
                "noise='learned' to infer it)."
            )
        if noise in ("fixed", "point") and noise_scale is not None:
            noise_scale = _noise_number(noise_scale, noise)
        if noise in ("learned", "heteroscedastic") and noise_scale is not None:
            raise ValueError(
                f"noise_scale fixes σ, but noise={noise!r} "
                + (
                    "infers σ as a latent site; drop noise_scale and set the prior with "
                    "noise_prior= (e.g. dist.LogNormal(math.log(s), 1.) around s)."
                    if noise == "learned"
                    else "reads σ(x) from the network; drop noise_scale."
                )
            )
        if noise_prior is not None and noise != "learned":
            raise ValueError(
                f"noise_prior is the prior of a learned σ; got it with noise={noise!r}. Pass "
                "noise='learned', or drop noise_prior."
            )
        if split is not None and noise != "heteroscedastic":
            raise ValueError(
                f"split belongs to a heteroscedastic regressor; got it with noise={noise!r}. "
                "Use models.heteroscedastic_regressor, or drop split."
            )
        if split is not None and not callable(split):
            raise TypeError(
                f"split must be callable out -> (mean, log_var); got {split!r}. Pass a function, "
                "e.g. split=lambda out: (out[:, 0], out[:, 1])."
            )
        if noise == "learned":
            noise_prior = check_noise_prior(
                default_noise_prior() if noise_prior is None else noise_prior
            )
        self.shape = NetworkShape(net)
        self._check_static_outputs(likelihood, noise, multilabel, split)
        self.net = net
        self.likelihood = likelihood
        self.dataset_size = int(dataset_size)
        self.noise = noise
        self.noise_prior = noise_prior
        self.multilabel = bool(multilabel)
        self.split = split
        self.output = check_output(output)
        self.shift = bool(shift)
        self.check_inputs = True
        self.name = _claim_name(name, self)
        self._fixed = float(noise_scale) if noise == "fixed" else None  # type: ignore[arg-type]
        self._sigma = (
            NoiseSite(
                noise,
                noise_prior,
                1.0 if noise_scale is None else noise_scale,
                param_name(self.name, SIGMA),
            )
            if noise in ("fixed", "learned", "point")
            else None
        )
        self._task = {
            "categorical": "classification",
            "bernoulli": "multilabel" if multilabel else "binary",
            "gaussian": "regression",
            "tokens": "tokens",
        }[likelihood]
        # The output width: read from the last layer, else learnt on the first call (which runs
        # under rollback, since its outputs are checked only after the forward pass).
        self._width = self.shape.outputs
        self._first = True

    def _check_static_outputs(self, likelihood, noise, multilabel, split) -> None:
        k = self.shape.outputs
        if k is None:
            return
        if likelihood == "gaussian" and noise != "heteroscedastic" and k != 1:
            raise ValueError(_multi_output(f"its last layer gives {k} outputs"))
        if noise == "heteroscedastic" and split is None and k != 2:
            raise ValueError(
                f"a heteroscedastic regressor needs 2 outputs per example (mean, log-variance); "
                f"the network's last layer gives {k}. Give the last layer 2 outputs, or pass "
                "split=lambda out: (mean, log_var)."
            )
        if likelihood == "tokens" and k is not None and k < 2:
            raise ValueError(
                f"a token-level likelihood needs one logit per vocabulary entry; the network's "
                f"last layer gives {k}. Pass output= selecting the language-model logits, or "
                "give the last layer one output per vocabulary entry."
            )
        if likelihood == "bernoulli" and not multilabel and k != 1:
            raise ValueError(
                f"a binary classifier needs one logit per example; the network's last layer "
                f"gives {k}. Use models.multilabel_classifier for {k} independent labels or "
                f"models.classifier for {k} exclusive classes."
            )

    @property
    def noise_scale(self) -> float | None:
        """σ: the fixed value, the current point estimate, or ``None`` (σ learned as a latent
        site or given by the network, or no Gaussian likelihood)."""
        if self._fixed is not None:
            return self._fixed
        if self.noise == "point":
            assert self._sigma is not None
            return self._sigma.current()
        return None

    @property
    def param_names(self) -> tuple[str, ...]:
        """The names of the params this model creates in Pyro's param store (a point σ's
        ``"<name>.sigma"``; none otherwise: the network's weights are sample sites)."""
        return (self._sigma.param,) if self.noise == "point" and self._sigma else ()

    def __call__(
        self, x: Batch, y: torch.Tensor | None = None, *extra: object, **unexpected: object
    ) -> torch.Tensor:
        if extra or unexpected:
            raise _call_error(extra, unexpected)
        width = self._width if self._task in ("classification", "multilabel", "tokens") else None
        if self.check_inputs and isinstance(x, torch.Tensor):
            self.shape.check_batched(x)  # before the rows of x and y are compared
        expected = self.shape.device() if self.check_inputs else None
        vocabulary = self.shape.vocabulary if self.check_inputs else None
        check_batch(
            x, y, task=self._task, num_classes=width, device=expected, vocabulary=vocabulary
        )
        first = next(iter(batch_tensors(x).values()))
        rows, device = first.shape[0], first.device
        if y is not None and rows > self.dataset_size:
            raise ValueError(
                f"the batch has {rows} rows but dataset_size is {self.dataset_size}: the "
                "likelihood is scaled by N/B, which needs B <= N. Pass dataset_size = the number "
                "of training examples, or smaller batches (y=None predicts on any number of rows)."
            )
        if self.likelihood == "gaussian" and y is not None and y.dim() != 1:
            # Checked again against the output after the forward pass; refused here first,
            # before the network runs.
            if y.dim() == 2 and y.shape[1] > 1:
                raise ValueError(
                    _multi_output(f"y has {y.shape[1]} targets per example, shape {tuple(y.shape)}")
                )
            raise ValueError(
                f"y must have the network output's shape ({rows},); got {tuple(y.shape)}. Use "
                f"y.reshape({rows})."
            )
        if self.check_inputs and isinstance(x, torch.Tensor):
            self.shape.check_inputs(x)
        # The first call checks the output's shape only after the forward pass, and a Gaussian
        # likelihood checks its range (the output against y and σ) after it on every call.
        if not (self._first or (self.likelihood == "gaussian" and y is not None)):
            return self._run(x, y, rows, device)
        with rollback(self.net, device):
            out = self._run(x, y, rows, device)
        self._first = False
        return out

    def network_output(self, x: Batch) -> torch.Tensor:
        """The tensor the likelihood reads: the network called on the batch ``x`` (a tensor,
        mapping or tuple), its output reduced by :attr:`output` (no checks, no sites of its
        own; a method that replays the network alone calls this)."""
        return select_output(call_network(self.net, x), self.output)

    def prediction(self, x: Batch) -> torch.Tensor:
        """What a call of the model on the batch ``x`` returns, without its likelihood site (so
        :func:`~pyro_bdl.predictive.sample_outputs` draws the same values as ``Predictive``'s
        ``"_RETURN"``): :meth:`network_output` in float32 if the layers ran in 16 bits, and a
        one-output regressor's or binary classifier's ``(B, 1)`` as ``(B,)``, the shape of
        its labels."""
        rows = next(iter(batch_tensors(x).values())).shape[0]
        return self._returned(self.network_output(x), rows)

    def _returned(self, out: torch.Tensor, rows: int) -> torch.Tensor:
        """:meth:`prediction` of the network output ``out`` of a batch of ``rows`` rows."""
        if out.dtype in (torch.float16, torch.bfloat16):
            # The layers ran in 16 bits (under autocast, or a network kept in 16 bits: a
            # bfloat16 base under float32 LoRA adapters); the likelihood, a sum over the batch
            # and a sequence's tokens, runs in float32, as autocast does for torch's own losses
            # and Hugging Face's losses do for the logits (in bfloat16 a sequence's
            # log-likelihood of -1940 nats rounds to a multiple of 8).
            out = out.float()
        one_column = (self.likelihood == "bernoulli" and not self.multilabel) or (
            self.likelihood == "gaussian" and self.noise != "heteroscedastic"
        )
        if one_column and out.dim() >= 2 and out.shape[-1] == 1 and _rows_at(out, rows, core=2):
            out = out.squeeze(-1)
        return out

    def _run(self, x: Batch, y: torch.Tensor | None, rows: int, device) -> torch.Tensor:
        out = self._returned(self.network_output(x), rows)
        if self.likelihood == "categorical":
            fn, value = self._categorical(out, y, rows)
        elif self.likelihood == "tokens":
            fn, value = self._tokens(out, y, rows, x)
        elif self.likelihood == "bernoulli":
            fn, value, out = self._bernoulli(out, y, rows)
        else:
            fn, value, out = self._gaussian(out, y, rows)
        with data_plate(self.dataset_size, rows, device):
            pyro.sample("y", fn, obs=value, infer={LIKELIHOOD: True})
        return out

    def _tokens(self, logits, y, rows, x):
        """A categorical per scored token, summed over the sequence: one term of the data plate
        per sequence. A token is scored where its label is not :data:`IGNORE_INDEX` and the
        batch's ``attention_mask`` (if any) is 1; with :attr:`shift`, logits at t predict the
        label at t+1."""
        if not _rows_at(logits, rows, core=3):
            raise ValueError(
                f"a token-level likelihood needs network outputs of shape ({rows}, T, V), one "
                f"logit per vocabulary entry at every position; got {tuple(logits.shape)}. Pass "
                "output= selecting the language-model logits."
            )
        length = logits.shape[-2]
        if y is not None and y.shape[1] != length:
            raise ValueError(
                f"y has {y.shape[1]} positions but the network gives logits for {length}; pass "
                f"labels of shape ({rows}, {length}) (y = batch['input_ids'] for next-token "
                "prediction)."
            )
        mask = x.get("attention_mask") if isinstance(x, Mapping) else None
        if mask is not None and tuple(mask.shape) != (rows, length):
            raise ValueError(
                f"x['attention_mask'] has shape {tuple(mask.shape)}; expected ({rows}, {length}), "
                "one entry per position of the logits."
            )
        if y is not None and self._width != logits.shape[-1]:
            # Checked before the forward pass against no width (the first call of an opaque
            # network) or the last layer's, which the network's forward did not keep.
            check_token_range(y, logits.shape[-1])
        self._width = logits.shape[-1]
        if self.shift:
            logits = logits[..., :-1, :]
            y = None if y is None else y[:, 1:]
            mask = None if mask is None else mask[:, 1:]
        scored = torch.ones(logits.shape[-3:-1], dtype=torch.bool, device=logits.device)
        if mask is not None:
            scored = scored & mask.bool()
        value = None
        if y is not None:
            scored = scored & (y != IGNORE_INDEX)
            value = y.masked_fill(~scored, 0)
        fn = _LogSoftmaxCategorical(logits, checked=value).mask(scored).to_event(1)
        return fn, value

    def _categorical(self, logits, y, rows):
        if not _rows_at(logits, rows, core=2):
            raise ValueError(
                f"a classifier needs network outputs of shape ({rows}, C), one logit per class; "
                f"got {tuple(logits.shape)}. Use models.binary_classifier for one logit per row."
            )
        if y is not None and self._width != logits.shape[-1]:
            # Checked before the forward pass against no width (the first call of an opaque
            # network) or the last layer's, which the network's forward did not keep.
            lo, hi = label_range(y)
            if lo < 0 or hi >= logits.shape[-1]:
                raise ValueError(
                    f"class labels must lie in [0, {logits.shape[-1]}); got min {lo}, max {hi}. "
                    "Check the label encoding or the network's number of outputs."
                )
        self._width = logits.shape[-1]
        # The labels were checked against this width (before the forward pass, or just now).
        return _LogSoftmaxCategorical(logits, checked=y), y

    def _bernoulli(self, logits, y, rows):
        want = (rows, self._width or logits.shape[-1]) if self.multilabel else (rows,)
        core = len(want)
        if not _rows_at(logits, rows, core) or tuple(logits.shape[-core:]) != want:
            raise ValueError(
                f"a {self._task} classifier needs network outputs of shape "
                f"{'(B, K)' if self.multilabel else '(B,) or (B, 1)'}, one logit per label; got "
                f"{tuple(logits.shape)}."
            )
        if y is not None and y.shape != logits.shape[logits.dim() - y.dim() :]:
            raise ValueError(
                f"y has shape {tuple(y.shape)} but the network gives logits of shape "
                f"{tuple(logits.shape)}, one per label; pass one label column per output (or "
                "change the network's last layer)."
            )
        if self.multilabel:
            self._width = logits.shape[-1]
        fn = dist.Bernoulli(logits=logits)
        value = None if y is None else y.to(logits.dtype)
        return (fn.to_event(1) if self.multilabel else fn), value, logits

    def _gaussian(self, out, y, rows):
        if self.noise == "heteroscedastic":
            mean, log_var = (self.split or mean_log_variance)(out)
            if not (_rows_at(mean, rows, 1) and _rows_at(log_var, rows, 1)):
                raise ValueError(
                    f"a heteroscedastic regressor needs a mean and a log-variance of shape "
                    f"({rows},) each; the network gave {tuple(out.shape)} and split gave "
                    f"{tuple(mean.shape)} and {tuple(log_var.shape)}. Give the network 2 outputs "
                    "(mean, log-variance) or pass split=lambda out: (mean, log_var)."
                )
            scale = (0.5 * log_var).exp()
            ret = out
        else:
            mean = out  # a (B, 1) output is (B,) by now: see prediction
            if not _rows_at(mean, rows, 1):
                raise ValueError(_multi_output(f"it gave outputs of shape {tuple(out.shape)}"))
            assert self._sigma is not None
            scale = self._sigma(mean)
            ret = mean
        if y is not None and y.shape != mean.shape[mean.dim() - y.dim() :]:
            raise ValueError(
                f"y must have the network output's shape {tuple(mean.shape)}; got "
                f"{tuple(y.shape)}. Use y.reshape({tuple(mean.shape)})."
            )
        if y is None:
            return dist.Normal(mean, scale), y, ret
        check_likelihood_range(y, mean, scale, self.dataset_size / rows, where=self._where())
        # The batch check found y finite and the range check the mean finite and σ finite and
        # positive: Normal's own validation would read each verdict back again.
        return dist.Normal(mean, scale, validate_args=False), y, ret

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy``, ``pickle``, ``torch.save``/``torch.load``) keeps its name
        where the name is free (a run loaded in another program), so that a checkpoint's params
        still match; a copy made while the original lives gets a fresh name and a copy of the
        original's point σ, so that training one leaves the other as it was."""
        self.__dict__.update(state)
        if self.name not in _LIVE:
            _LIVE[self.name] = self
            return
        old = self.name
        self.name = _claim_name(None, self)
        if self._sigma is not None:
            # copy.copy shares the original's NoiseSite: rename a copy of it.
            self._sigma = copy.copy(self._sigma)
            self._sigma.param = param_name(self.name, SIGMA)
            store = pyro.get_param_store()
            if self.noise == "point" and param_name(old, SIGMA) in store:
                value = store[param_name(old, SIGMA)].detach().clone()
                store.setdefault(self._sigma.param, value, constraint=constraints.positive)

    def _where(self) -> str:
        if self.noise == "heteroscedastic":
            return "σ(x) from the network"
        if self.noise == "point":
            assert self._sigma is not None
            return f"param {self._sigma.param!r}"
        return "latent site 'sigma'" if self.noise == "learned" else "fixed"

    def __repr__(self) -> str:
        extra = ""
        if self.likelihood == "gaussian":
            extra = f", noise={self.noise!r}"
            if self._fixed is not None:
                extra += f", noise_scale={self._fixed}"
        if self.multilabel:
            extra += ", multilabel=True"
        return (
            f"NetworkModel({type(self.net).__name__}, likelihood={self.likelihood!r}, "
            f"dataset_size={self.dataset_size}{extra}, name={self.name!r})"
        )


def mean_log_variance(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The default split of a heteroscedastic regressor's outputs ``(B, 2)``: column 0 is the
    mean, column 1 the log-variance."""
    if out.dim() < 2 or out.shape[-1] != 2:
        raise ValueError(
            f"a heteroscedastic regressor's network must output shape (B, 2), (mean, "
            f"log-variance); got {tuple(out.shape)}. Pass split=lambda out: (mean, log_var) "
            "for another layout."
        )
    return out[..., 0], out[..., 1]


def _call_error(extra: tuple, unexpected: Mapping[str, object]) -> TypeError:
    """The error for a call with arguments beyond ``(x, y=None)``: what came, and the fix."""
    if extra:
        kinds = ", ".join(
            f"{type(a).__name__}{tuple(a.shape) if isinstance(a, torch.Tensor) else ''}"
            for a in extra
        )
        return TypeError(
            f"the model takes (x, y=None) but got {len(extra)} more positional argument(s): "
            f"{kinds}. A data loader that yields (x, y, index) or more gives a batch to unpack "
            f"first: `x, y, {'_' if len(extra) == 1 else '*_'} = batch; svi.step(x, y)` (for "
            "several network inputs pass them as one tuple x=(x1, x2))."
        )
    return TypeError(
        f"the model takes (x, y=None) but got keyword argument(s) {sorted(unexpected)}. Pass "
        "the targets as y (svi.step(x, y) or svi.step(x, y=labels)); inputs the network takes "
        "by keyword go inside x as a dict (x={'input_ids': ..., 'attention_mask': ...})."
    )


def _noise_number(noise_scale: object, noise: str) -> float:
    """``noise_scale`` as a float σ > 0; refuses a tensor of several σ, and a fixed σ given as a
    tensor that requires grad (``float`` would cut it from its graph: a σ meant to be learned
    would silently stay fixed). A point σ's start may be any one-number tensor."""
    if isinstance(noise_scale, torch.Tensor):
        if noise_scale.requires_grad and noise == "fixed":
            raise TypeError(
                "noise_scale must be a fixed number σ; got a tensor that requires grad, which "
                "the model would turn into a constant (no gradient would reach it). To learn σ "
                "pass noise='point' (a param starting at noise_scale) or noise='learned' (a "
                "latent site)."
            )
        if noise_scale.numel() != 1:
            raise ValueError(
                f"noise_scale must be one number σ; got a tensor of shape "
                f"{tuple(noise_scale.shape)}. For σ that differs between examples use "
                "models.heteroscedastic_regressor (σ(x) from the network), or write a model "
                "with dist.Normal(mean, sigma) inside models.data_plate."
            )
        noise_scale = noise_scale.detach()
    check_positive("noise_scale", noise_scale, fix="Pass the observation noise σ > 0.")  # type: ignore[arg-type]
    return float(noise_scale)  # type: ignore[arg-type]


def _multi_output(what: str) -> str:
    return (
        f"a regressor needs one output per example, shape (B,) or (B, 1); {what}. For a mean "
        "and a log-variance use models.heteroscedastic_regressor; for several targets write a "
        "model with dist.Normal(mean, σ).to_event(1) inside models.data_plate."
    )


def _rows_at(out: torch.Tensor, rows: int, core: int) -> bool:
    """Whether ``out`` has ``core`` dims with ``rows`` first, after leading sample dims, which
    only a plate (vectorized particles, parallel prediction) can add to the weights."""
    if out.dim() < core or out.shape[out.dim() - core] != rows:
        return False
    return out.dim() == core or under_plate()
