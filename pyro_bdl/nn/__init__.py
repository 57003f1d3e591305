"""Declarative lifting of PyTorch networks into Bayesian ``PyroModule`` s."""

from pyro_bdl.nn.lift import DEFAULT_HIDE, SiteSpec, bayesianize, init_to_network, site_spec, sites

__all__ = ["DEFAULT_HIDE", "SiteSpec", "bayesianize", "init_to_network", "site_spec", "sites"]
