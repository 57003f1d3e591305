"""Deprecated: moved to :mod:`pyro_bdl.app.compare`; this path goes in the next release.

``pyro_bdl.compare.laplace`` was the subnetwork Laplace (now ``app.compare.subnet_laplace``) and
``pyro_bdl.compare.full_laplace`` the full-network one (now ``app.compare.laplace``)."""

from pyro_bdl._moved import alias_moved

alias_moved(
    __name__,
    "pyro_bdl.app.compare",
    {
        **{
            name: name
            for name in (
                "checks",
                "ensemble",
                "evaluate",
                "map",
                "networks",
                "problem",
                "registry",
                "swag",
                "temperature",
                "tuning",
                "variational",
                "vogn",
            )
        },
        "laplace": "subnet_laplace",
        "full_laplace": "laplace",
        "vogn_fit": "vogn",
    },
)
