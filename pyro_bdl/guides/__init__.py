"""Pyro guides for lifted networks. Every guide here is an ordinary Pyro guide: ``Predictive``,
``poutine``, ``state_dict`` checkpoints and the diagnostics work the same for all of them."""

__all__: list[str] = []
