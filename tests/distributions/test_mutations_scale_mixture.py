"""ScaleMixtureNormal's density against an independent float64 evaluation (scipy), with neither
scale equal to 1 so that every normalising term log sₖ counts."""

import numpy as np
import torch
from scipy.stats import norm

from pyro_bdl.distributions import ScaleMixtureNormal
from tests.common import assert_close


def test_log_prob_is_the_log_of_the_weighted_normal_densities():
    pi = torch.tensor([0.3, 0.8], dtype=torch.float64)
    scale1 = torch.tensor([2.0, 0.4], dtype=torch.float64)
    scale2 = torch.tensor([0.05, 3.0], dtype=torch.float64)
    d = ScaleMixtureNormal(pi, scale1, scale2)
    x = torch.tensor([[0.0, 0.0], [0.1, -1.0], [-2.5, 4.0]], dtype=torch.float64)
    p, s1, s2, xn = pi.numpy(), scale1.numpy(), scale2.numpy(), x.numpy()
    expected = np.log(p * norm.pdf(xn, scale=s1) + (1 - p) * norm.pdf(xn, scale=s2))
    assert_close(d.log_prob(x), torch.from_numpy(expected), rtol=1e-12)
    # Expanded from scalars, each element is the same one-dimensional mixture.
    e = ScaleMixtureNormal(pi[0], scale1[0], scale2[0]).expand((3,))
    assert_close(e.log_prob(x[:, 0]), torch.from_numpy(expected[:, 0]), rtol=1e-12)
