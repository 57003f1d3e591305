"""Declarative lifting of PyTorch networks into Bayesian ``PyroModule`` s."""

from pyro_bdl.nn import pretrained
from pyro_bdl.nn.convert import LayerNotLiftable
from pyro_bdl.nn.lift import (
    DEFAULT_HIDE,
    SiteSpec,
    bayesianize,
    init_to_network,
    site_spec,
    sites,
    unlift,
)
from pyro_bdl.nn.lift_rules import ExposeOnly, lora, lora_and_head

__all__ = [
    "DEFAULT_HIDE",
    "ExposeOnly",
    "LayerNotLiftable",
    "SiteSpec",
    "bayesianize",
    "init_to_network",
    "lora",
    "lora_and_head",
    "pretrained",
    "site_spec",
    "sites",
    "unlift",
]
